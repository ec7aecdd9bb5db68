"""Shared fixtures: the shipped stories260K checkpoints, where ../shared is, real config files."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the test machine has no Hub; nothing may try it
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One CPU thread in the test processes and every process they start (what a test asks for itself wins):
# tiny models gain nothing from more, and three workers on two cores spin each other's OpenMP threads.
# tests/test_threads.py and test_train_config.py remove it where the choice without it is what is tested.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MODELS = SHARED / "data" / "models"
CONFIGS = SHARED / "data" / "configs"
CORPORA = SHARED / "data" / "corpora"
EXAMPLES = REPO / "examples"
EXAMPLE_MHA8 = EXAMPLES / "stories260K-mha8"  # the real stories260K with its 4 K/V heads duplicated
TRAIN_TXT = EXAMPLES / "data" / "tinystories-train-sample.txt"
VALID_TXT = EXAMPLES / "data" / "tinystories-valid-sample.txt"
TEST_CONFIGS = REPO / "tests" / "data" / "configs"  # copies of permissively licensed config.json files

# Models the tests build once per test run (so a clone without ../shared runs them), removed at exit.
# One folder for all pytest-xdist workers: the controller (or a plain pytest) makes it and removes it
# when it exits; its workers, started after this import, find it in their inherited environment. One
# folder, so that every worker's runs name the same model (a resumed run checks that it is its own).
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("UPTRAIN_TESTS_BUILT"):
    BUILT = Path(os.environ["UPTRAIN_TESTS_BUILT"])
else:
    BUILT = Path(tempfile.mkdtemp(prefix="uptrain-tests-"))
    os.environ["UPTRAIN_TESTS_BUILT"] = str(BUILT)
    atexit.register(shutil.rmtree, BUILT, True)


@contextlib.contextmanager
def exclusive(lock_file: Path):
    """Hold an exclusive lock on `lock_file` (another pytest-xdist worker may be making the same thing)."""
    with open(lock_file, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def need_shared(path: Path) -> Path:
    """Skip the calling test (with the reason) when a file from ../shared is absent."""
    if not path.exists():
        pytest.skip(f"needs {path} (../shared is absent on this machine)")
    return path


def built_gqa4() -> Path:
    """The original stories260K (4 K/V heads), rebuilt from the shipped MHA copy by mean pooling.

    Lossless: mha8 duplicates each of gqa4's K/V heads, and the mean of equal values is exact, so
    the weights are bit-identical to ../shared's stories260K-gqa4. Built on first use, then reused.
    """
    out = BUILT / "stories260K-gqa4"
    with exclusive(BUILT / "stories260K-gqa4.lock"):
        if not (out / "config.json").is_file():
            from uptrain.convert import convert
            convert(str(EXAMPLE_MHA8), out, 4)
    return out


def real_config(name: str) -> Path:
    """A public checkpoint's config.json: the copy under tests/data/configs, else ../shared's."""
    shipped = TEST_CONFIGS / f"{name}.json"
    return shipped if shipped.is_file() else need_shared(CONFIGS / f"{name}.json")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One CPU thread: tiny models gain nothing from more, and lose a lot on a busy machine."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def mha8() -> Path:
    """The real stories260K in MHA form (8 K/V heads), as shipped in examples/."""
    return EXAMPLE_MHA8


@pytest.fixture
def gqa4() -> Path:
    """The real stories260K (4 K/V heads), built from the shipped MHA copy (see built_gqa4)."""
    return built_gqa4()


@pytest.fixture
def original_gqa4() -> Path:
    """Karpathy's stories260K exactly as published (../shared): the reference a conversion must hit."""
    return need_shared(MODELS / "stories260K-gqa4")


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make) -> dict:
    """`make(folder)`'s result (a JSON dict), made once per test run in `folder`, even under pytest -n N.

    Each xdist worker is its own process with its own session fixtures: the first worker to ask
    makes the result in the folder all workers of the run share (under a file lock); the others
    wait for it and read it. A make that fails leaves no result, so the next one to ask tries again.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-xdist: each worker's basetemp is a folder of this shared one
    folder, done = root / name, root / f"{name}.json"
    with exclusive(root / f"{name}.lock"):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            done.write_text(json.dumps(make(folder)))
        return json.loads(done.read_text())


@pytest.fixture(scope="session")
def fsdp2_runs(tmp_path_factory):
    """(one-process run, shard=fsdp2 two-process run, the latter's overrides, its stdout): the pair
    of tests/train_helpers.py's PAIR_* settings, made once for test_train_fsdp2.py and test_elastic.py.

    Read only: a test that resumes or changes a run works on a copy of its folder.
    """
    from train_helpers import launch_two_processes, need_models, pair_args, train_in_process

    def make(tmp: Path) -> dict:
        single, sharded = tmp / "single", tmp / "sharded"
        train_in_process(pair_args(single))
        args = pair_args(sharded, sharded=True)
        return {"single": str(single), "sharded": str(sharded), "args": args,
                "stdout": launch_two_processes(args).stdout}

    need_models()
    made = made_once(tmp_path_factory, "fsdp2-pair", make)
    return Path(made["single"]), Path(made["sharded"]), made["args"], made["stdout"]


@pytest.fixture(scope="session")
def sgd_two_processes(tmp_path_factory):
    """(run folder, stdout) of tests/train_helpers.py's SGD run on two real processes (accelerate
    launch, gloo DDP), made once for test_train_multiproc.py and test_multinode.py. Read only."""
    from train_helpers import SGD_STEPS, SGD_TWO_PROCESSES, launch_two_processes, need_models, tiny_overrides

    def make(tmp: Path) -> dict:
        run_dir = tmp / "double"
        proc = launch_two_processes(tiny_overrides(run_dir, steps=SGD_STEPS, **SGD_TWO_PROCESSES))
        return {"run_dir": str(run_dir), "stdout": proc.stdout}

    need_models()
    made = made_once(tmp_path_factory, "sgd", make)
    return Path(made["run_dir"]), made["stdout"]


# ---------------------------------------------------------------- workers (scripts/test.sh: pytest -n 3 --dist loadfile)

# The longest files first (their measured CPU and time: results/suite-time.md, scripts/bench/suite_cpu.py), so that
# no worker is left running one of them alone at the end. Order only: every file still runs.
LONGEST_FIRST = ("tests/train/test_slurm.py",  # mostly waiting on slurmctld: started first, its waits overlap the rest
                 "tests/test_readme_uptrain.py", "tests/train/test_preempt.py", "tests/train/test_train_fsdp2.py",
                 "tests/test_readme.py", "tests/test_gpu_check.py", "tests/train/test_elastic.py",
                 "tests/train/test_multinode.py", "tests/convert/test_source.py", "tests/test_demo.py",
                 "tests/train/test_train_multiproc.py", "tests/test_paper.py", "tests/test_sweep.py",
                 "tests/convert/test_refine_cli.py", "tests/train/test_train.py", "tests/train/test_setup_stop.py",
                 "tests/measure/test_tasks.py", "tests/measure/test_deploy.py", "tests/train/test_hub_model.py",
                 "tests/train/test_train_teacher_samples.py", "tests/convert/test_layer_stream.py",
                 "tests/convert/test_shards.py", "tests/convert/test_architectures.py")


def _file(nodeid: str) -> str:
    return nodeid.split("::")[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first, each file's own order kept."""
    rank = {name: n for n, name in enumerate(LONGEST_FIRST)}
    seen = {name: n for n, name in enumerate(dict.fromkeys(_file(item.nodeid) for item in items))}
    items.sort(key=lambda item: (rank.get(_file(item.nodeid), len(rank)), seen[_file(item.nodeid)]))  # stable


# ---------------------------------------------------------------- progress per test file

SUITE_IDLE_2CORE_S = 578  # the whole suite (scripts/test.sh: 3 workers) on a 2-core machine with nothing else running:
# `bash .ci/run` in clean clones, 2026-12-03: 579 s with ../shared, 576 s without (results/suite-time.md). README says so
_progress: dict = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    """Say how many files and tests will run and how long the whole suite takes when idle."""
    if not hasattr(session.config, "workerinput"):  # a worker of pytest -n N: its controller says it
        _start_progress(session.config, [item.nodeid for item in session.items])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """pytest -n N (xdist's controller): every worker collects the same tests; count them once."""
    if not _progress:
        _start_progress(node.config, ids)


def _start_progress(config: pytest.Config, nodeids: list[str]) -> None:
    files: dict[str, int] = {}
    for nodeid in nodeids:
        files[nodeid.split("::")[0]] = files.get(nodeid.split("::")[0], 0) + 1
    _progress.update(left=dict(files), total=dict(files), done=0, start=time.monotonic(), file_start={})
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and files:
        reporter.write_line(f"{len(files)} test files, {len(nodeids)} tests (the whole suite: about "
                            f"{round(SUITE_IDLE_2CORE_S / 60)} min on an idle 2-core machine)")


def pytest_runtest_logstart(nodeid: str, location) -> None:
    _progress.get("file_start", {}).setdefault(nodeid.split("::")[0], time.monotonic())


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    """When the last test of a file finishes: '[k/N] FILE n tests in X s (m:ss so far)'."""
    left = _progress.get("left")
    file = nodeid.split("::")[0]
    if not left or file not in left:
        return
    left[file] -= 1
    if left[file]:
        return
    _progress["done"] += 1
    now = time.monotonic()
    took, so_far = now - _progress["file_start"].get(file, now), int(now - _progress["start"])
    n = _progress["total"][file]
    reporter = _CONFIG.pluginmanager.get_plugin("terminalreporter") if _CONFIG else None
    if reporter is not None:
        if reporter._tw.width_of_current_line:  # after -q's dots: a line of its own
            reporter._tw.line()
        reporter.write_line(f"[{_progress['done']}/{len(left)}] {file} {n} test{'s' * (n != 1)} in {took:.1f} s "
                            f"({so_far // 60}:{so_far % 60:02d} so far)", flush=True)


_CONFIG: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _CONFIG
    _CONFIG = config


def perturbed_copy(source: Path, folder: Path, seed: int, scale: float = 0.3) -> Path:
    """A copy of the model folder `source` whose attention heads all differ: every q/k/v/o weight
    gets seeded noise of `scale` x its RMS (the shipped MHA model's K/V heads are duplicated in
    pairs, which hides what grouping and calibration change). The source is not modified."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    generator = torch.Generator().manual_seed(seed)
    for path in folder.glob("*.safetensors"):
        tensors = load_file(path)
        for name, t in tensors.items():
            if any(p in name for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
                noise = torch.randn(t.shape, generator=generator, dtype=torch.float32)
                tensors[name] = (t.float() + scale * t.float().pow(2).mean().sqrt() * noise).to(t.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return folder
