"""An auto-picked attention kernel that fails on the backend: the engine falls back to blocked attention with one
warning line, and its scores are blocked attention's, bit for bit (``mia.engine.failsafe``).

The CPU cannot fail the real cuDNN or Mosaic kernels the way a GPU or TPU would, so auto is made to pick a kernel
(``attention.auto_kernel`` patched) whose program fails at the stage under test, each time a real failure of XLA
(on one attention step; the token-stats and conditional steps of the engine at the end):
  lower    the real Pallas splash kernel outside interpret mode (Mosaic refuses to lower it for the CPU), and cuDNN's
           ``jax.nn.dot_product_attention`` (no cuDNN here)
  compile  a custom call to a kernel nobody registered (XLA's compiler finds no implementation)
  run      a host callback that raises while the program runs
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mia.doctor import tiny_models
from mia.engine.batching import ScoringSettings
from mia.engine.conditional import loglik_matrix
from mia.engine.failsafe import FailSafeStep, fail_safe
from mia.engine.loop import compute_token_stats
from mia.models import attention as A

SETTINGS = ScoringSettings(progress=False, pack=False)
LENGTHS = (128, 100, 77, 128, 3)  # one bucket: the model reads 128 positions a row, so the real splash kernel is
# traced (and fails to lower)


def _compile_failure(*args, scale, window=None):
    out = A.blocked_attention(*args, scale=scale, window=window)
    return jax.ffi.ffi_call("mia_kernel_nobody_registered", jax.ShapeDtypeStruct(out.shape, out.dtype),
                            vmap_method="sequential")(out)


def _run_failure(*args, scale, window=None):
    out = A.blocked_attention(*args, scale=scale, window=window)

    def fault(x):
        raise RuntimeError("simulated kernel fault")

    return jax.pure_callback(fault, jax.ShapeDtypeStruct(out.shape, out.dtype), out, vmap_method="sequential")


def _cudnn(q, k, v, *rest, scale, window=None):
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    return A._jax_attention(*bf16, *rest, scale=scale, window=window, implementation="cudnn").astype(v.dtype)


SLOW = pytest.mark.slow
FAILING = {  # stage -> (kernel auto picks, its failing implementation, what the warning's reason says)
    "lower": ("splash", partial(A.splash_attention, interpret=False), "Only interpret mode is supported"),
    "lower-cudnn": ("xla", _cudnn, "cuDNN"),
    "compile": ("splash", _compile_failure, "mia_kernel_nobody_registered"),
    "run": ("xla", _run_failure, "simulated kernel fault"),
}


@pytest.fixture(autouse=True)
def fresh_failures():
    A.reset_failed_kernels()
    yield
    A.reset_failed_kernels()


def warning_lines(err: str) -> list:
    return [line for line in err.splitlines() if line.startswith("warning: attention kernel")]


# ------------------------------------------------------------------------------------------------ one attention step
def attention_inputs():
    """q, k, v [2, 128, 4, 16] (GQA: 2 kv heads), positions, and a right-padded second row."""
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 128, 4, 16)).astype(np.float32)
    k, v = (rng.normal(size=(2, 128, 2, 16)).astype(np.float32) for _ in range(2))
    valid = np.ones((2, 128), bool)
    valid[1, 90:] = False
    pos = np.broadcast_to(np.arange(128, dtype=np.int32), (2, 128))
    return q, k, v, pos, valid


def attention_step():
    """An engine-style step: a new jit of a new function per build, wrapped by ``fail_safe``."""
    return fail_safe(lambda: jax.jit(lambda q, k, v, pos, valid: A.dot_product_attention(q, k, v, pos, pos, valid,
                                                                                          scale=0.25)))


# the default run keeps compile and run here; "lower" runs through the engine below (the real splash kernel)
@pytest.mark.parametrize("stage", [pytest.param(s, marks=SLOW) if s.startswith("lower") else s for s in FAILING])
def test_failing_auto_kernel_falls_back_to_blocked(stage, monkeypatch, capsys):
    kernel, failing, reason = FAILING[stage]
    args = attention_inputs()
    want = jax.jit(lambda q, k, v, pos, valid: A.blocked_attention(q, k, v, pos, pos, valid, scale=0.25))(*args)
    monkeypatch.setattr(A, "auto_kernel", lambda *a, **k: kernel)
    monkeypatch.setitem(A.KERNELS, kernel, failing)
    got = attention_step()(*args)
    lines = warning_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"warning: attention kernel {kernel} failed on this backend (")
    assert lines[0].endswith("); using blocked") and reason in lines[0], lines[0]
    assert set(A.failed_kernels()) == {kernel}
    assert np.array_equal(got, want)  # the fallback is blocked attention, not close to it
    # from now on auto picks blocked at once here (planning for a named backend is not affected)
    assert A.select_kernel(1, 4, 128, 128, 16, jnp.float32) == "blocked"
    assert A.select_kernel(1, 4, 128, 128, 16, jnp.float32, backend="cpu") == kernel
    attention_step()(*args)
    assert warning_lines(capsys.readouterr().err) == []  # once per process


def test_explicitly_requested_kernel_that_fails_is_an_error_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv(A.ENV_VAR, "splash")
    monkeypatch.setitem(A.KERNELS, "splash", _compile_failure)
    with pytest.raises(A.KernelError) as e:
        attention_step()(*attention_inputs())
    msg = str(e.value)
    assert "MIA_ATTENTION=splash" in msg and "mia_kernel_nobody_registered" in msg and "\n" not in msg
    assert isinstance(e.value, ValueError)  # a user error: one `error:` line from the command line
    assert A.failed_kernels() == {} and warning_lines(capsys.readouterr().err) == []


def test_with_several_processes_no_process_falls_back_alone(monkeypatch, capsys):
    """One process rebuilding its step with blocked attention would run another program than the other processes:
    under jax.distributed the failure is a one-line error naming the process and MIA_ATTENTION=blocked. (Simulated
    here; that the other processes stop too, with one line each: tests/test_hosts.py, in process for the watchdog
    and, under -m slow, with two real processes.)"""
    monkeypatch.setattr(A, "auto_kernel", lambda *a, **k: "splash")
    monkeypatch.setitem(A.KERNELS, "splash", _compile_failure)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with pytest.raises(A.KernelError) as e:
        attention_step()(*attention_inputs())
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, ValueError)
    assert "splash" in msg and "process 1 of 2" in msg and "MIA_ATTENTION=blocked" in msg
    assert "mia_kernel_nobody_registered" in msg
    assert A.failed_kernels() == {} and warning_lines(capsys.readouterr().err) == []  # nothing marked, no fallback


def test_a_failure_that_blocked_shares_is_not_blamed_on_the_kernel(monkeypatch, capsys):
    """When blocked attention fails as well, the original error comes out: no warning, no kernel marked."""
    monkeypatch.setattr(A, "auto_kernel", lambda *a, **k: "splash")
    monkeypatch.setitem(A.KERNELS, "splash", _compile_failure)
    monkeypatch.setitem(A.KERNELS, "blocked", _run_failure)
    with pytest.raises(Exception, match="mia_kernel_nobody_registered"):
        attention_step()(*attention_inputs())
    assert A.failed_kernels() == {} and warning_lines(capsys.readouterr().err) == []


@SLOW
def test_a_kernel_failing_outside_an_engine_step_falls_back_in_place(monkeypatch, capsys):
    """cuDNN failing when a model call is jitted outside the engine: that call runs blocked, one warning."""
    monkeypatch.setattr(A.jax, "default_backend", lambda: "gpu")  # xla_attention then asks for cuDNN
    args = attention_inputs()
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in args[:3]]
    got = A.xla_attention(*bf16, args[3], args[3], args[4], scale=0.25)
    want = A.blocked_attention(*bf16, args[3], args[3], args[4], scale=0.25)
    assert np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert len(warning_lines(capsys.readouterr().err)) == 1 and "xla" in A.failed_kernels()


# ------------------------------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def base_model():
    return tiny_models("gpt_neox")["float32"]  # random weights drawn with NumPy: no init program to compile


@pytest.fixture(scope="module")
def seqs():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 128, n).astype(np.int32) for n in LENGTHS]


def fresh(model):
    """The same weights as a new Model: the engine's jitted steps are cached per Model, so nothing is reused."""
    return dataclasses.replace(model)


def test_token_stats_fall_back_to_blocked_scores(base_model, seqs, monkeypatch, capsys):
    """The real splash kernel, which Mosaic will not lower for a CPU, picked by auto for the token-stats step."""
    with monkeypatch.context() as m:
        m.setenv(A.ENV_VAR, "blocked")
        want = compute_token_stats(fresh(base_model), seqs, SETTINGS)
    monkeypatch.setattr(A, "auto_kernel", lambda *a, **k: "splash")
    monkeypatch.setitem(A.KERNELS, "splash", FAILING["lower"][1])
    capsys.readouterr()
    got = compute_token_stats(fresh(base_model), seqs, SETTINGS)
    assert len(warning_lines(capsys.readouterr().err)) == 1
    for g, w in zip(got, want):
        for stat in w:
            assert np.array_equal(g[stat], w[stat]), stat


@SLOW
def test_conditional_steps_fall_back_too(base_model, seqs, monkeypatch, capsys):
    """The prefix pass and the conditional-LL call (ReCaLL, EM-MIA) are guarded like the token-stats step."""
    with monkeypatch.context() as m:
        m.setenv(A.ENV_VAR, "blocked")
        want = loglik_matrix(fresh(base_model), seqs[:2], seqs[2:], include_first=True, settings=SETTINGS)
    monkeypatch.setattr(A, "auto_kernel", lambda *a, **k: "splash")
    monkeypatch.setitem(A.KERNELS, "splash", _run_failure)
    capsys.readouterr()
    got = loglik_matrix(fresh(base_model), seqs[:2], seqs[2:], include_first=True, settings=SETTINGS)
    assert len(warning_lines(capsys.readouterr().err)) == 1
    assert np.array_equal(got, want)


def test_every_engine_step_builder_is_fail_safe(base_model):
    """Each builder the engine and ``mia plan`` share returns the guarded step (built, not traced: cheap)."""
    from mia.attacks.mope import build_mope_step
    from mia.engine.conditional import build_cond_step, build_prefix_step, jitted_token_logprobs, prefix_shardings
    from mia.engine.generate import Sampling, build_decode_step
    from mia.engine.loop import build_token_stats_step, engine_layout

    model = fresh(base_model)
    mesh, shardings = engine_layout(model)
    cache = prefix_shardings(model, mesh)
    steps = [build_token_stats_step(model, mesh, shardings), build_prefix_step(model, mesh, shardings, cache),
             build_cond_step(model, mesh, shardings, cache, True), jitted_token_logprobs(model),
             build_decode_step(model, mesh, shardings, Sampling(max_new=4)),
             build_mope_step(model, mesh, shardings, 2, 0.01, 1)]
    assert all(isinstance(s, FailSafeStep) for s in steps)
    assert all(callable(s.lower) for s in steps)  # `mia plan` lowers them as before


def test_failure_reason_is_one_line():
    assert A.failure_reason(ValueError("bad\nmore")) == "ValueError: bad"
    callback = RuntimeError("INTERNAL: CpuCallback error calling callback: Traceback (most recent call last):\n"
                            "  File x\nRuntimeError: simulated kernel fault")
    assert A.failure_reason(callback) == ("RuntimeError: INTERNAL: CpuCallback error calling callback: RuntimeError: "
                                          "simulated kernel fault")
    assert len(A.failure_reason(ValueError("x" * 1000))) == 200
