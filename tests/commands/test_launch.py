"""``--nproc N`` (autoprec/commands/launch.py): a rank's error is printed once, by the launcher,
naming the ranks that raised it, with the failing rank's exit code and no torchrun traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from autoprec.cli import main
from autoprec.commands.launch import LAUNCHED_ENV, peer_left, record_rank_error, report_failure
from autoprec.errors import AutoprecError
from autoprec.policy import Policy
from tests.conftest import MODELS


def _recorded(tmp_path, monkeypatch, rank: int, message: str | None, exitcode: int = 2) -> ProcessFailure:
    """torchrun's record of a failed rank, its error file written as a rank under launch() writes it
    (``message`` None: the rank recorded nothing, e.g. a crash or a signal)."""
    path = tmp_path / f"error_{rank}.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv(LAUNCHED_ENV, "train")
    if message is not None:
        assert record_rank_error(AutoprecError(message))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_a_rank_outside_launch_prints_its_own_error(tmp_path, monkeypatch):
    monkeypatch.delenv(LAUNCHED_ENV, raising=False)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "e.json"))  # plain torchrun: not ours
    assert not record_rank_error(AutoprecError("x"))
    assert not (tmp_path / "e.json").exists()


def test_the_same_error_on_every_rank_is_printed_once(tmp_path, monkeypatch):
    failures = {r: _recorded(tmp_path, monkeypatch, r, "p.json: rules[1]: matches no node") for r in (0, 1)}
    text, code = report_failure("train", failures, first=0)
    assert text == "autoprec train: error on ranks 0, 1: p.json: rules[1]: matches no node"
    assert code == 2


def test_different_errors_each_name_their_rank_and_the_first_failures_code(tmp_path, monkeypatch):
    failures = {0: _recorded(tmp_path, monkeypatch, 0, "a", exitcode=2),
                1: _recorded(tmp_path, monkeypatch, 1, "loss scale collapsed", exitcode=1)}
    text, code = report_failure("bench", failures, first=1)
    assert text.splitlines() == ["autoprec bench: error on rank 0: a",
                                 "autoprec bench: error on rank 1: loss scale collapsed"]
    assert code == 1


def test_a_crash_or_a_signal_names_the_rank_and_how_it_ended(tmp_path, monkeypatch):
    crashed = {1: _recorded(tmp_path, monkeypatch, 1, None, exitcode=1),
               0: _recorded(tmp_path, monkeypatch, 0, None, exitcode=-15)}  # stopped by torchrun after
    text, code = report_failure("train", crashed, first=1)
    assert text == "autoprec train: error: rank 1 failed (exit code 1); its output is above"
    assert code == 1
    killed = {0: _recorded(tmp_path, monkeypatch, 0, None, exitcode=-9)}
    text, code = report_failure("train", killed, first=0)
    assert text == "autoprec train: error: rank 0 failed (signal 9 (SIGKILL)); its output is above"
    assert code == 1


def test_a_cause_the_launcher_ended_after_its_peer_left_is_not_called_a_signal(tmp_path, monkeypatch):
    """Rank 1 raised (its traceback is printed) and hung in teardown; rank 0's all-reduce broke
    (recorded as a peer that left) and exited first, so torchrun sent rank 1 SIGTERM: rank 1 is named,
    and its SIGTERM is said to be the launcher's, not a signal of its own."""
    path = tmp_path / "error_0.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv(LAUNCHED_ENV, "train")
    assert record_rank_error(RuntimeError("Connection closed by peer [127.0.0.1]:1234"), peer=True)
    failures = {0: ProcessFailure(local_rank=0, pid=1000, exitcode=1, error_file=str(path)),
                1: _recorded(tmp_path, monkeypatch, 1, None, exitcode=-15)}
    text, code = report_failure("train", failures, first=0)
    assert text == ("autoprec train: error: rank 1 failed (its exit cut short by the launcher once rank 0 "
                    "lost it); its output is above"), text
    assert code == 1


@pytest.mark.heavy
def test_train_nproc_prints_a_one_rank_error_once_without_a_traceback(tmp_path, capfd):
    """A model file that fails to import on rank 1 only (two real torchrun ranks): the launcher prints
    rank 1's error once, exit 2, and neither torchrun's ChildFailedError traceback nor its
    OMP_NUM_THREADS warning."""
    model = tmp_path / "rank1_fails.py"
    model.write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    raise RuntimeError('rank one cannot read its shard')\n"
        + (MODELS / "ddp_mlp.py").read_text())
    policy = tmp_path / "fp32.json"
    Policy.fp32().save(policy)
    code = main(["train", str(model), "--policy", str(policy), "--steps", "2", "--no-compile", "--device",
                 "cpu", "--nproc", "2"])
    out, err = capfd.readouterr()
    assert code == 2, out + err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and lines[0].startswith("autoprec train: error on rank 1: "), err
    assert "rank one cannot read its shard" in lines[0] and str(model) in lines[0]
    assert "Traceback" not in err and "ChildFailedError" not in err and "OMP_NUM_THREADS" not in err


def _tagged(tag: str) -> list[int]:
    """PIDs of the live processes whose environment holds ``AUTOPREC_TEST_TAG=tag`` (Linux /proc)."""
    pids = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"AUTOPREC_TEST_TAG={tag}".encode() in env.read_bytes().split(b"\0"):
                pids.append(int(env.parent.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return pids


@pytest.mark.heavy
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_ctrl_c_on_the_launcher_stops_every_rank(tmp_path):
    """SIGINT to ``autoprec train --nproc 2`` alone (not its process group): the launcher had been
    SIGKILLed on its way out and the ranks trained on, orphaned. Now torchrun stops them: exit 130,
    one "interrupted" line, no process of the run left."""
    policy = tmp_path / "fp32.json"
    Policy.fp32().save(policy)
    tag = uuid.uuid4().hex
    env = {**os.environ, "AUTOPREC_TEST_TAG": tag, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "autoprec.cli", "train", str(MODELS / "ddp_mlp.py"), "--policy", str(policy),
           "--steps", "100000000", "--no-compile", "--device", "cpu", "--nproc", "2", "--log-every", "1000"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = p.stdout.readline()
        if first.startswith("2 ranks: "):  # the line saying what the numbers printed are
            first = p.stdout.readline()
        assert first.startswith("step"), first  # the ranks train
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=90)
        deadline = time.monotonic() + 10
        while _tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _tagged(tag)
    finally:
        p.kill()
        for pid in _tagged(tag):  # a failed run leaves nothing behind either
            os.kill(pid, signal.SIGKILL)
    assert p.returncode == 130, err
    assert err.count("interrupted after") == 1, err
    assert left == []


def test_a_rank_whose_collective_broke_because_another_left_is_not_named(tmp_path, monkeypatch):
    """Rank 0's all-reduce broke because rank 1 failed and exited ("Connection closed by peer"), and
    rank 0's exit reached torchrun first: the launcher names rank 1, whose error is the cause."""
    peer = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:34230")
    assert peer_left(peer) and not peer_left(RuntimeError("shape mismatch"))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error_0.json"))
    monkeypatch.setenv(LAUNCHED_ENV, "train")
    assert record_rank_error(peer, peer=True)
    echo = ProcessFailure(local_rank=0, pid=1000, exitcode=1, error_file=str(tmp_path / "error_0.json"))
    crashed = _recorded(tmp_path, monkeypatch, 1, None, exitcode=1)
    text, code = report_failure("train", {0: echo, 1: crashed}, first=0)
    assert text == "autoprec train: error: rank 1 failed (exit code 1); its output is above"
    assert code == 1


@pytest.mark.heavy
def test_a_rank_failing_mid_training_ends_the_run_with_its_error(tmp_path):
    """Rank 1's get_batch raises at step 3, while rank 0 waits in the step's all-reduce: the run
    hung (rank 1 waited in a barrier rank 0 never reached; gloo's timeout is 30 minutes). Now rank 1
    exits with its traceback, rank 0's broken all-reduce is not printed, and the launcher names
    rank 1: exit 1 within the deadline."""
    model = tmp_path / "rank1_step_fails.py"
    text = (MODELS / "ddp_mlp.py").read_text()
    assert "def get_batch(step" in text
    model.write_text(text.replace("def get_batch(step", "def _get_batch(step") + (
        "\n\ndef get_batch(step, device):\n"
        "    import os\n"
        "    if os.environ.get('RANK') == '1' and step >= 6:\n"
        "        raise ValueError(f'shard of step {step} is corrupt')\n"
        "    return _get_batch(step, device)\n"))
    policy = tmp_path / "fp32.json"
    Policy.fp32().save(policy)
    cmd = [sys.executable, "-m", "autoprec.cli", "train", str(model), "--policy", str(policy),
           "--steps", "10", "--no-compile", "--device", "cpu", "--nproc", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "ValueError: shard of step 7 is corrupt" in r.stderr, r.stderr
    last = r.stderr.rstrip().splitlines()[-1]
    # rank 1 exits 1, or, when its teardown hangs in gloo's threads past rank 0's exit, torchrun ends it
    assert last in ("autoprec train: error: rank 1 failed (exit code 1); its output is above",
                    "autoprec train: error: rank 1 failed (its exit cut short by the launcher once rank 0 "
                    "lost it); its output is above"), r.stderr
    assert "[rank0]" not in r.stderr and "Connection closed" not in r.stderr, r.stderr
