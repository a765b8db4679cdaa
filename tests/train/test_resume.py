"""`kill -9` in the middle of a run, then resume: the losses after resume equal the uninterrupted run's exactly.
SIGTERM saves a checkpoint before exiting, and resuming from it is exact too."""

import os
import signal
import subprocess
import sys
import time

import pytest
from train_runs import read_metrics, tiny_raw_config, write_toml

pytestmark = pytest.mark.slow

STEPS = 40


def _cmd(cfg, run_dir):
    return [sys.executable, "-m", "mtpkit", "train", str(cfg), f"--train.run_dir={run_dir}"]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def _wait_for(cond, proc, timeout=180):
    t0 = time.time()
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before the test could interrupt it: "
                                 + proc.stderr.read()[-3000:])
        if time.time() - t0 > timeout:
            proc.kill()
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.02)


def _records_equal(ref: list[dict], got: list[dict], from_step: int):
    ref = {r["step"]: r for r in ref}
    steps = [r["step"] for r in got]
    assert steps == list(range(1, STEPS + 1)), steps
    for r in got:
        if r["step"] > from_step:
            want = ref[r["step"]]
            for key in ("loss", "main_loss", "mtp_loss", "mtp_acc", "grad_norm", "lr"):
                assert r[key] == want[key], (r["step"], key, r[key], want[key])  # bit-identical


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The config and the uninterrupted reference run (in a subprocess, like the interrupted ones)."""
    root = tmp_path_factory.mktemp("resume")
    raw = tiny_raw_config(root, train={"steps": STEPS, "batch_size": 2, "micro_batch_size": 1},
                          data={"seq_len": 24}, checkpoint={"every": 2, "keep": 2})
    cfg = write_toml(root / "cfg.toml", raw)
    proc = subprocess.run(_cmd(cfg, root / "ref"), env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, cfg, read_metrics(root / "ref")


def test_kill_9_mid_run_then_resume_matches_uninterrupted(setup):
    from mtpkit.train.state import latest_checkpoint

    root, cfg, ref = setup
    run = root / "killed"
    proc = subprocess.Popen(_cmd(cfg, run), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # let it write a checkpoint and train past it, then kill it without warning
    _wait_for(lambda: (run / "checkpoints" / "step-00000004").exists() and len(read_metrics_safe(run)) >= 5, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    done = len(read_metrics_safe(run))
    assert done < STEPS, "the run finished before it was killed"
    ckpt_step = int(latest_checkpoint(run).name.split("-")[1])
    assert 4 <= ckpt_step <= done

    again = subprocess.run(_cmd(cfg, run), env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {latest_checkpoint(run).parent / f'step-{ckpt_step:08d}'}" in again.stderr
    _records_equal(ref, read_metrics(run), from_step=ckpt_step)


def test_sigterm_saves_a_checkpoint_and_resume_is_exact(setup):
    from mtpkit.train.state import latest_checkpoint

    root, cfg, ref = setup
    run = root / "term"
    proc = subprocess.Popen(_cmd(cfg, run) + ["--checkpoint.every=0"], env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: len(read_metrics_safe(run)) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "received SIGTERM" in err
    stopped = len(read_metrics(run))
    assert latest_checkpoint(run).name == f"step-{stopped:08d}"  # saved at the step it stopped after
    again = subprocess.run(_cmd(cfg, run) + ["--checkpoint.every=0"], env=_env(), capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    _records_equal(ref, read_metrics(run), from_step=stopped)


def read_metrics_safe(run):
    try:
        return read_metrics(run)
    except (FileNotFoundError, ValueError):  # not written yet, or a line half-written
        return []
