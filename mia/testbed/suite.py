"""A testbed suite, like Pythia: several model sizes trained on the identical data order with the same checkpoints.

``build_suite("smoke")`` (or ``python -m mia.testbed --suite smoke``) builds the corpus, tokenizer and training
order once (in the first member), shares them with every other member (hard links, or copies), and trains each
member in turn; each member is a normal testbed directory (``open_testbed``, ``experiments.checkmia --testbed``,
``mia score --model DIR/checkpoints/stepN`` use it as any other). Members share every
:data:`~mia.testbed.config.DATA_FIELDS` (corpus, vocabulary, seq_len, batch size, steps, checkpoint steps, seed: the
same rows at the same step) and differ in the model (width, depth, heads) and learning rate, as Pythia's sizes do.

Layout of a suite directory::

    suite.json          name, members (name, directory, config hash, parameters), the shared data's sha256
    <size>/             one testbed per member, named by its parameter count ("45k", "1.2m")

A member's order and tokenizer are verified byte-identical through the sha256 its manifest records (the build
hashes the files it wrote or linked); ``open_suite`` refuses a suite whose members disagree.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from ..files.atomic import write_json
from .build import DEFAULT_ROOT, MANIFEST, Testbed, build_from_config, open_testbed, share_data
from .config import DATA_FIELDS, PRESETS, SUITE_FIELDS, TestbedConfig, TestbedError, read_manifest

SUITE_FORMAT = "mia-suite/1"
SUITE_MANIFEST = "suite.json"


def _members(base: TestbedConfig, name: str, models: tuple) -> tuple:
    """Configs of a suite: ``base``'s data fields with each (hidden_size, num_layers, num_heads, lr) model."""
    return tuple(base.replace(preset=f"{name}-{size_name(base.replace(hidden_size=h, num_layers=n).n_params())}",
                              hidden_size=h, num_layers=n, num_heads=a, lr=lr)
                 for h, n, a, lr in models)


def size_name(n_params: int) -> str:
    """Pythia-style size label: 45000 -> "45k", 164000 -> "164k", 1_234_567 -> "1.2m"."""
    if n_params < 1_000_000:
        return f"{round(n_params / 1000)}k"
    return f"{n_params / 1e6:.1f}m".replace(".0m", "m")


SUITES: dict[str, tuple[TestbedConfig, ...]] = {
    # the smoke preset's data (0.8 MB of stdlib, vocab 512, 100 steps x 16 rows of 65 tokens, checkpoints 0/50/100)
    # at three sizes; the middle one is the smoke preset's model, so its directory is also the smoke testbed
    "smoke": _members(PRESETS["smoke"], "smoke", ((16, 1, 2, 3e-3), (64, 2, 4, 3e-3), (96, 2, 4, 3e-3))),
    # the default preset's data (the whole stdlib, vocab 2048, 400 steps x 32 rows of 129 tokens, checkpoints every
    # 100 steps) at three sizes; the largest is the default preset's model
    "default": _members(PRESETS["default"], "default", ((16, 1, 2, 2e-3), (64, 2, 4, 2e-3), (128, 2, 4, 2e-3))),
}


def check_same_data(configs) -> None:
    """Raise unless every config has the same data fields (same rows at the same steps, same checkpoints)."""
    first = configs[0]
    for c in configs[1:]:
        diff = [k for k in DATA_FIELDS if getattr(c, k) != getattr(first, k)]
        if diff:
            raise TestbedError(f"suite members {first.preset} and {c.preset} differ in data field(s) "
                               f"{', '.join(diff)}; "
                               "a suite trains every size on the same data order")


def _member_dir_name(cfg: TestbedConfig) -> str:
    return size_name(cfg.n_params())


@dataclasses.dataclass
class Suite:
    """A built suite: ``members`` ordered by parameter count, each a complete :class:`Testbed`."""

    name: str
    root: Path
    members: list  # list[Testbed], smallest first
    manifest: dict

    @property
    def names(self) -> list:
        """Size labels of the members ("45k", ...), in member order."""
        return [m["name"] for m in self.manifest["members"]]

    @property
    def sizes(self) -> list:
        """Parameter counts of the members (at the real vocabulary), in member order."""
        return [tb.n_params for tb in self.members]

    @property
    def steps(self) -> list:
        """Checkpoint steps every member saved."""
        return sorted(set.intersection(*(set(tb.steps) for tb in self.members)))

    def member(self, size_name: str) -> Testbed:
        if size_name not in self.names:
            raise TestbedError(f"suite {self.name} has no member {size_name!r}; members: {', '.join(self.names)}")
        return self.members[self.names.index(size_name)]

    def summary(self) -> str:
        tb = self.members[0]
        lines = [f"suite {self.name} at {self.root}: {len(self.members)} members on one order of {tb.n_rows} rows of "
                 f"{tb.row_len} tokens, batch {tb.batch_size}, {tb.train_steps} steps, checkpoints "
                 f"{', '.join(map(str, self.steps))}"]
        for name, t in zip(self.names, self.members):
            c = t.config
            lines.append(f"  {name:>6}: {t.n_params:>10,} params ({c.num_layers} layers x {c.hidden_size}, "
                         f"{c.num_heads} heads, lr {c.lr:g}), final loss {t.manifest['train']['final_loss']:.3f}, "
                         f"trained in {t.manifest['timings'].get('train_s', float('nan')):.1f} s")
        return "\n".join(lines)


DATA_HASHES = ("tokenizer", "order_bin", "order_idx", "perm", "corpus")  # what suite.json's 'data' records


def data_hashes(tb: Testbed) -> dict:
    """sha256 of what a suite's members must share: tokenizer, order .bin/.idx, row permutation, corpus."""
    m = tb.manifest
    out = {}
    for name, path in (("tokenizer", ("tokenizer", "sha256")), ("order_bin", ("data", "bin", "sha256")),
                       ("order_idx", ("data", "idx", "sha256")), ("perm", ("data", "perm_sha256")),
                       ("corpus", ("corpus", "sha256"))):
        v = m
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        if not isinstance(v, str):
            raise TestbedError(f"{tb.root / MANIFEST}: field {'.'.join(path)} must be a sha256 string, got "
                               f"{type(v).__name__}; delete the directory to rebuild")
        out[name] = v
    return out


def verify_members(members: list, expected: Optional[dict] = None) -> dict:
    """The shared data hashes; raise naming the member whose data differ from the first's (or ``expected``)."""
    ref = expected or data_hashes(members[0])
    for tb in members:
        got = data_hashes(tb)
        bad = [k for k in ref if got.get(k) != ref[k]]
        if bad:
            raise TestbedError(f"{tb.root}: its {', '.join(bad)} differ(s) from the suite's shared data "
                               f"(sha256 {got[bad[0]][:12]} != {ref[bad[0]][:12]}); rebuild this member")
    check_same_data([tb.config for tb in members])
    return ref


def build_suite(name: str, out_dir=None, *, progress: bool = True, save_every: int = 50) -> Suite:
    """Build (or resume, or reuse) suite ``name`` of :data:`SUITES` in ``out_dir`` (default ``testbeds/suite-<name>``).

    The first (smallest) member builds the data; the others start from it (:func:`~mia.testbed.build.share_data`)
    and only train. Each member's build time is recorded in its manifest (``timings.train_s``).
    """
    if name not in SUITES:
        raise TestbedError(f"unknown suite {name!r}; suites: {', '.join(SUITES)}")
    configs = sorted(SUITES[name], key=lambda c: c.n_params())
    check_same_data(configs)
    root = Path(out_dir) if out_dir is not None else Path(DEFAULT_ROOT) / f"suite-{name}"
    root.mkdir(parents=True, exist_ok=True)
    entries = [{"name": _member_dir_name(c), "dir": _member_dir_name(c), "config_hash": c.config_hash} for c in configs]
    mf = root / SUITE_MANIFEST
    old = None
    if mf.exists():
        old = read_manifest(mf, SUITE_FIELDS)
        hashes = [e.get("config_hash") if isinstance(e, dict) else None for e in old.get("members", [])]
        if old.get("format") != SUITE_FORMAT or old.get("name") != name or \
                hashes != [e["config_hash"] for e in entries]:
            raise TestbedError(f"{root} holds another suite ({str(old.get('name'))[:40]!r}, "
                               f"{str(old.get('format'))[:40]!r}) or one built by another version (its {mf.name}); "
                               "delete it to rebuild, or use another --out")
    m = {"format": SUITE_FORMAT, "name": name, "complete": False, "members": entries}
    if not (old and old.get("complete")):
        # an unfinished build is marked as such; a complete suite stays complete while it is checked and reused, so
        # that another process opening it meanwhile (open_suite) is not refused
        write_json(mf, m, indent=1)

    members = []
    for i, (cfg, e) in enumerate(zip(configs, entries)):
        mroot = root / e["dir"]
        if i > 0:
            mroot.mkdir(parents=True, exist_ok=True)
            share_data(members[0].root, cfg, mroot)
        if progress:
            print(f"suite {name}: member {e['name']} ({i + 1}/{len(configs)}, {cfg.n_params():,} params)", flush=True)
        members.append(build_from_config(cfg, mroot, progress=progress, save_every=save_every))
    m["data"] = verify_members(members)
    for e, tb in zip(entries, members):
        e["n_params"] = tb.n_params
        e["timings"] = {k: v for k, v in tb.manifest["timings"].items() if k.endswith("_s")}
    m["complete"] = True
    if m != old:  # a reused suite is left as it is (nothing rewritten)
        write_json(mf, m, indent=1)
    return Suite(name, root, members, m)


def open_suite(path) -> Suite:
    """Open a complete suite directory (no building); its members' shared data are verified."""
    root = Path(path)
    mf = root / SUITE_MANIFEST
    if not mf.exists():
        raise TestbedError(f"{root}: not a testbed suite (no {SUITE_MANIFEST}); build one with "
                           f"python -m mia.testbed --suite NAME --out {root}")
    m = read_manifest(mf, SUITE_FIELDS)
    if m.get("format") != SUITE_FORMAT:
        raise TestbedError(f"{root}: a suite of another version ({m.get('format')}, now {SUITE_FORMAT}); rebuild it")
    if not m.get("complete"):
        raise TestbedError(f"{root}: suite build is incomplete; rerun python -m mia.testbed --suite {m.get('name')} "
                           f"--out {root} to finish it")
    data, entries = m.get("data"), m.get("members")
    if not isinstance(m.get("name"), str) or not entries or not all(
            isinstance(e, dict) and all(isinstance(e.get(k), str) for k in ("name", "dir", "config_hash"))
            for e in entries) or not isinstance(data, dict) or set(data) != set(DATA_HASHES) \
            or not all(isinstance(v, str) for v in data.values()):
        raise TestbedError(f"{mf}: 'name' must be a string, 'members' a non-empty list of objects with 'name', "
                           f"'dir' and 'config_hash' strings, and 'data' an object of the sha256 strings of "
                           f"{', '.join(DATA_HASHES)}; delete the directory to rebuild")
    members = []
    for e in m["members"]:
        tb = open_testbed(root / e["dir"])
        if tb.config.config_hash != e["config_hash"]:
            raise TestbedError(f"{root / e['dir']}: holds config {tb.config.config_hash}, the suite says "
                               f"{e['config_hash']}")
        members.append(tb)
    verify_members(members, m["data"])
    return Suite(m["name"], root, members, m)
