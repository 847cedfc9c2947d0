"""Engine steps that survive an attention kernel failing on this backend.

Auto dispatch (``mia.models.attention.select_kernel``) picks cuDNN's flash attention on a GPU and Pallas splash
attention on a TPU. Neither is plain JAX, and a backend may fail to lower (cuDNN missing, a Mosaic error), compile
(an unsupported configuration) or run (out of VMEM) either. ``fail_safe(build)`` wraps a jitted engine step so that
such a failure never ends a run with a traceback and never changes a number quietly:

  * each call records which kernels a freshly traced program contains (``attention.recording_kernels``); when it
    holds xla or splash, the first run of that program is waited for, so a run-time failure surfaces here, not at
    a later fetch;
  * when the call fails and the program holds a kernel of ``attention.FALLIBLE``: under auto, that kernel is marked
    failed for this process, the step is rebuilt (auto now picks ``blocked`` everywhere in it) and the call repeated;
    if it succeeds, one ``warning: attention kernel K failed on this backend (reason); using blocked`` line is
    printed (once per kernel and process) and the run carries on, every later program with blocked attention. Its
    scores are blocked attention's, bit for bit. If the repeat fails too, the failure was not the kernel's: the
    mark is undone and the original error raised;
  * when ``MIA_ATTENTION`` asked for the kernel, nothing falls back: ``attention.KernelError`` (a one-line user
    error) names the variable, the kernel and the reason;
  * with several processes (``jax.distributed``), nothing falls back either: one process alone rebuilding its step
    would run another program than the others (whose collectives then wait for it, or pair with the wrong ones).
    ``attention.KernelError`` names the kernel, the process and the way out (``MIA_ATTENTION=blocked`` on every
    process).

Batches already computed with the kernel before it failed keep their results (it ran them).
"""
from __future__ import annotations

from typing import Callable

import jax

from ..models import attention


class FailSafeStep:
    """A jitted step built by ``build()`` (a ``jax.jit`` object); called like it, and ``lower``, ``_cache_size`` and
    the other attributes of the current jit object are passed through (``mia plan`` lowers the step as built)."""

    def __init__(self, build: Callable[[], Callable]):
        self._build = build
        self._fn = build()

    def __getattr__(self, name):
        if name in ("_fn", "_build"):  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self._fn, name)

    def __call__(self, *args, **kwargs):
        with attention.recording_kernels() as used:
            try:
                out = self._fn(*args, **kwargs)
                if fallible(used):
                    jax.block_until_ready(out)  # the program's first run: a kernel's run-time error surfaces here
                return out
            except Exception as error:
                kernels = fallible(used)
                if not kernels or attention.is_forced():
                    raise
                failure = error
        return self._fall_back(kernels, failure, args, kwargs)

    def _fall_back(self, kernels: list, error: Exception, args, kwargs):
        reason = attention.failure_reason(error)
        asked = attention.requested_kernel()
        if asked in kernels:
            raise attention.explicit_request_error(asked, reason) from error
        if jax.process_count() > 1:
            raise attention.multiprocess_failure_error(kernels, reason, jax.process_index(),
                                                       jax.process_count()) from error
        newly = [k for k in kernels if attention.mark_failed(k, reason)]
        before, self._fn = self._fn, self._build()
        try:
            out = jax.block_until_ready(self._fn(*args, **kwargs))
        except Exception:
            for k in newly:
                attention.unmark_failed(k)
            self._fn = before
            raise error from None
        for k in kernels:
            attention.warn_fallback(k, attention.failed_kernels().get(k, reason))
        return out


def fallible(kernels: list) -> list:
    """The kernels of ``attention.FALLIBLE`` among ``kernels``, sorted, once each."""
    return sorted({k for k in kernels if k in attention.FALLIBLE})


def fail_safe(build: Callable[[], Callable]) -> FailSafeStep:
    """``build()``'s jitted step, falling back to blocked attention when an auto-picked kernel fails (module
    docstring). ``build`` must return a new jit object of a new function on every call (so the rebuilt step is traced
    again), as the engine's ``build_*_step`` closures do."""
    return FailSafeStep(build)
