"""Several runs per device and several devices per run: `compare --jobs 2` gives the
results of running the runs one after another; FSDP2 on 2 gloo processes computes the gradients of
one process on the same global batch (averaged, not summed) for every variant, and trains to the
same losses with full, exact checkpoints."""

from __future__ import annotations

import itertools
import json
import os
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from gbattn import files, rundir
from gbattn.errors import UserError
from gbattn.experiments.compare import run_compare
from helpers import TINY, write_corpus


def process_of_identical_peers(rank: int, world: int):
    """A DistEnv of process ``rank`` of ``world`` whose peers each contribute what this one does (their sums and
    gathers taken as its own), for a trainer run on a one-process group as one of several."""
    from gbattn.train.distributed import DistEnv

    class IdenticalPeers(DistEnv):
        def all_sum(self, values: list[float]) -> list[float]:
            return [self.world * v for v in values]

        def gather(self, obj) -> list:
            return [obj] * self.world

    return IdenticalPeers(rank=rank, world=world)


def pose_as_peer(monkeypatch, rank: int, world: int) -> None:
    """The trainer run as process ``rank`` of ``world`` identical peers (:func:`process_of_identical_peers`). Its check
    that every process sees rank 0's run directory is left out: here rank 0's lock token is this process's own
    (that check, with two real processes: test_processes_that_see_other_folders_or_were_given_other_runs_refuse)."""
    from gbattn.train import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "init_distributed",
                        lambda device_type: process_of_identical_peers(rank, world))
    monkeypatch.setattr(trainer_module.Trainer, "_check_one_run_directory", lambda self: None)


def test_compare_with_two_jobs_equals_one_after_another(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GBATTN_CACHE", str(tmp_path / "cache"))
    data = write_corpus(tmp_path / "c")
    sets = dict(TINY, max_steps=6, eval_every=3, tokenizer="char", batch_size=8, seq_len=32, sampling="rows",
                train_tokens=None, eval_tokens=None, warmup_steps=2)
    one = run_compare("cpu-proxy", tmp_path / "one", data=str(data), seeds=[1], sets=sets, quiet=True, threads=1)
    two = run_compare("cpu-proxy", tmp_path / "two", data=str(data), seeds=[1], sets=sets, quiet=True, threads=2,
                      jobs=2)
    assert [r["label"] for r in two["models"]] == [r["label"] for r in one["models"]]
    for a, b in zip(one["models"], two["models"]):
        assert a["test_ppl"] == b["test_ppl"] and a["steps"] == b["steps"], a["label"]
    for label in ("gba-m2", "compute-matched"):  # the compute-matched run waited for GBA's result
        wa = rundir.load_checkpoint(tmp_path / "one" / label / "seed1" / rundir.CHECKPOINT)["model"]
        wb = rundir.load_checkpoint(tmp_path / "two" / label / "seed1" / rundir.CHECKPOINT)["model"]
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    for result in two["models"]:  # 2 threads between 2 jobs: each run trained on 1
        config = rundir.read_config(tmp_path / "two" / result["label"] / "seed1" / rundir.CONFIG)
        assert config["train"]["threads"] == 1, result["label"]
    # A second invocation reuses every (checked) run: nothing is trained again. Asked for 2 jobs on 1 thread, it has
    # no run to divide it between, so no note of each run taking a thread of its own (the test beside this one has it)
    capsys.readouterr()
    again = run_compare("cpu-proxy", tmp_path / "two", data=str(data), seeds=[1], sets=sets, jobs=2, threads=1,
                        quiet=True)
    assert [r["test_ppl"] for r in again["models"]] == [r["test_ppl"] for r in two["models"]]
    assert "note: --jobs" not in capsys.readouterr().err



def test_compare_under_torchrun_says_it_runs_in_one_process(tmp_path, monkeypatch):
    """`torchrun -m gbattn compare`: every process would run the whole comparison (the second reported the
    first's lock as "in use by another gbattn process", the first was killed training): one line instead."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match=r"^compare runs in one process, not under torchrun \(2 processes here\): "
                                        r"--jobs N trains N of its runs at once; torchrun --nproc_per_node N -m "
                                        r"gbattn\.cli train trains one run on N processes$"):
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(write_corpus(tmp_path / "c")), seeds=[1], quiet=True)
    assert not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("command", [["eval", "RUN"], ["upcycle", "RUN", "--attn", "boosted", "--out", "OUT"],
                                     ["denoise", "--quick", "--out", "OUT"]])
def test_commands_other_than_train_refuse_torchrun_in_one_line(tmp_path, monkeypatch, capsys, command):
    """Under torchrun every process ran the whole command: eval printed its result once per process, and
    two upcycles raced for --out (the loser's "in use by another gbattn process" made torchrun stop the
    other, mid-write for a large model). One line, status 2, nothing written."""
    from helpers import run_cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [{"RUN": tmp_path / "run", "OUT": tmp_path / "out"}.get(a, a) for a in command]
    code, out, err = run_cli(capsys, argv)
    assert (code, out) == (2, ""), err
    assert err == (f"gbattn: error: gbattn {command[0]} runs in one process, not under torchrun (2 processes here): "
                   f"only gbattn train runs on several\n")
    assert not (tmp_path / "out").exists()


def _start_endless_comparison(tmp_path) -> tuple[subprocess.Popen, Path]:
    """`gbattn compare --jobs 2` of cpu-char at a tiny size with 100,000 steps a run (it is stopped by
    the test), as its own process: (process, comparison directory)."""
    data = write_corpus(tmp_path / "c")
    sets = dict(TINY, max_steps=100_000, eval_every=5, tokenizer="char", batch_size=4, seq_len=32,
                train_tokens="null", eval_tokens="null", warmup_steps=2)
    out = tmp_path / "cmp"
    env = dict(os.environ, GBATTN_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "gbattn", "compare", "--recipe", "cpu-char", "--data", str(data), "--seeds", "1",
            "--jobs", "2", "--threads", "2", "--out", str(out), "--quiet",
            *sum((["--set", f"{k}={v}"] for k, v in sets.items()), [])]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), out


def _two_runs_training(proc: subprocess.Popen, out: Path) -> list[Path]:
    """Wait (at most 2 minutes) until two of the comparison's runs have a checkpoint: their directories."""
    for _ in range(1200):
        runs = [p.parent for p in out.glob("*/seed1/" + rundir.CHECKPOINT)]
        if len(runs) >= 2:
            return runs
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    raise AssertionError("two runs did not start training within 2 minutes")


@pytest.mark.parametrize("signum, how", [(signal.SIGTERM, "terminated"), (signal.SIGINT, "interrupted"),
                                         (signal.SIGUSR1, "stopped by SIGUSR1")])
def test_a_terminated_comparison_stops_its_runs_and_says_how_to_resume(tmp_path, signum, how):
    """SIGTERM to `compare --jobs 2`: the running children stop (each at its checkpoint), and the
    comparison says so in one line with SIGTERM's exit status 143, instead of vanishing silently.
    Ctrl-C (SIGINT) says the same with status 130 (it said only "gbattn: interrupted"), and SLURM's SIGUSR1 with
    138 (it ended the comparison at once, silently; its runs stopped only because their parent died)."""
    proc, out = _start_endless_comparison(tmp_path)
    try:
        _two_runs_training(proc, out)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signum, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"gbattn: error: compare {how}: the runs in progress (") and last.endswith(
        "stopped at their last checkpoint; rerun the same command to resume"), err
    stopped = last.split("(", 1)[1].split(")", 1)[0].split(", ")
    assert len(stopped) == 2 and all((out / run / rundir.CHECKPOINT).is_file() for run in stopped), stopped
    for run in stopped:  # each was told to stop (SIGTERM), not killed: it recorded its interruption
        events = [json.loads(line)["event"] for line in (out / run / rundir.METRICS).read_text().splitlines()]
        assert "interrupted" in events, run


SLOW_TO_STOP_RUN = textwrap.dedent('''
    """A comparison's run that takes its time to reach a checkpoint after SIGTERM (a long step or evaluation) and
    stops at once on SIGINT; it writes its pid when it starts and the name of each signal it receives."""
    import os, signal, sys, time
    from pathlib import Path

    run = Path(sys.argv[sys.argv.index("--out") + 1])

    def mark(signum, frame):
        with open(run / "signals", "a") as f:
            f.write(signal.Signals(signum).name + "\\n")
        if signum == signal.SIGINT:
            sys.exit(130)

    signal.signal(signal.SIGTERM, mark)
    signal.signal(signal.SIGINT, mark)
    (run / "pid").write_text(str(os.getpid()))
    time.sleep(120)
''')

COMPARE_WITH_SLOW_RUNS = textwrap.dedent('''
    """`gbattn compare` whose runs are SLOW_TO_STOP_RUN (its path the first argument) instead of `gbattn train`."""
    import subprocess, sys
    from gbattn import cli

    real, run = subprocess.Popen, sys.argv.pop(1)
    subprocess.Popen = lambda cmd, **kwargs: real([sys.executable, run, *cmd[3:]], **kwargs)
    sys.exit(cli.main())
''')


def test_a_second_ctrl_c_stops_a_comparisons_runs_at_once_and_it_waits_for_them(tmp_path):
    """Ctrl-C asks the runs of `compare --jobs 2` to checkpoint and stop (SIGTERM) and waits for them; a second one,
    while a run was still on its way to its checkpoint, ended the comparison at once ("gbattn: interrupted"), its
    runs training on in its directory. Now the runs stop at once (SIGINT, as a second Ctrl-C stops `gbattn train`),
    and the comparison waits for them and says how to resume."""
    (tmp_path / "run.py").write_text(SLOW_TO_STOP_RUN)
    (tmp_path / "compare.py").write_text(COMPARE_WITH_SLOW_RUNS)
    out = tmp_path / "cmp"
    sets = dict(TINY, max_steps=10, tokenizer="char", batch_size=4, seq_len=32, train_tokens="null",
                eval_tokens="null", warmup_steps=2)
    argv = [sys.executable, str(tmp_path / "compare.py"), str(tmp_path / "run.py"), "compare", "--recipe", "cpu-char",
            "--data", str(write_corpus(tmp_path / "c")), "--seeds", "1", "--jobs", "2", "--threads", "2", "--out",
            str(out), "--quiet", *sum((["--set", f"{k}={v}"] for k, v in sets.items()), [])]
    env = dict(os.environ, GBATTN_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    runs: list[Path] = []
    try:
        deadline = time.monotonic() + 120  # a busy machine is slow, not wrong
        while len(runs) < 2 and proc.poll() is None and time.monotonic() < deadline:
            runs = [p.parent for p in out.glob("*/seed1/pid") if p.read_text()]
            time.sleep(0.05)
        assert len(runs) == 2, proc.stderr.read() if proc.poll() is not None else runs
        proc.send_signal(signal.SIGINT)
        while not all((run / "signals").exists() for run in runs) and time.monotonic() < deadline:
            time.sleep(0.05)  # each run was asked to stop at its checkpoint, and is on its way there
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        pids = [int((run / "pid").read_text()) for run in runs]
        assert not any(_alive(pid) for pid in pids), "the comparison ended with its runs training"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in [int((run / "pid").read_text()) for run in runs]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("gbattn: error: compare interrupted: the runs in progress ("), err
    assert all((run / "signals").read_text() == "SIGTERM\nSIGINT\n" for run in runs)


def test_compare_jobs_runs_at_most_jobs_at_once_and_names_each_failed_run(tmp_path, monkeypatch, capsys):
    """--jobs 2 with every run's process failing: never more than two at once; each failure named with
    its exit status and its log's last line; the compute-matched runs never start (their reference
    failed) and say so; the comparison fails saying to rerun. 2 threads for 2 jobs draws no note."""
    from gbattn.experiments import compare as compare_mod

    real, started, live_at_start = subprocess.Popen, [], []

    def failing_run(cmd, **kwargs):  # a run's process, failing after a second
        live_at_start.append(sum(p.poll() is None for p in started))
        started.append(real([sys.executable, "-c", "import time; time.sleep(1); print('boom'); raise SystemExit(3)"],
                            **kwargs))
        return started[-1]

    data = write_corpus(tmp_path / "c")
    sets = dict(TINY, max_steps=2, eval_every=2, tokenizer="char", batch_size=8, seq_len=32, train_tokens=None,
                eval_tokens=None, warmup_steps=1)
    monkeypatch.setattr(compare_mod.subprocess, "Popen", failing_run)
    with pytest.raises(UserError) as failed:
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(data), seeds=[1, 2], sets=sets,
                    only=["standard", "gba-m2", "compute-matched"], threads=2, jobs=2)
    assert len(started) == 4 and max(live_at_start) == 1, live_at_start
    message = str(failed.value)
    assert message.startswith("6 run(s) failed: ") and message.endswith("; rerun the same command to retry them")
    for seed in (1, 2):
        assert f"standard/seed{seed} (exit 3: boom)" in message and f"gba-m2/seed{seed} (exit 3: boom)" in message
        assert f"compute-matched/seed{seed} (not trained: the run it starts from or is matched to failed)" in message
    assert "note:" not in capsys.readouterr().err


def test_compare_jobs_names_the_signal_that_killed_a_run_and_only_its_own_output(tmp_path, monkeypatch):
    """A run of `compare --jobs 2` killed by SIGKILL (the OOM killer) after an earlier attempt stopped was reported
    as `(exit -9: gbattn: error: terminated at step 85; ...)`: the earlier attempt's last line of train.log, which
    every attempt appends to. Now the signal is named and the line is this attempt's own, "no output" where it wrote
    none."""
    from gbattn.experiments import compare as compare_mod

    real, attempts = subprocess.Popen, iter([
        "print('gbattn: error: terminated at step 85'); raise SystemExit(143)",  # the earlier invocation's attempt
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",  # killed before it wrote a line
        "import os, signal; print('step 90', flush=True); os.kill(os.getpid(), signal.SIGKILL)",
    ])
    monkeypatch.setattr(compare_mod.subprocess, "Popen",
                        lambda cmd, **kwargs: real([sys.executable, "-c", next(attempts)], **kwargs))
    sets = dict(TINY, max_steps=2, eval_every=2, tokenizer="char", batch_size=8, seq_len=32, train_tokens=None,
                eval_tokens=None, warmup_steps=1)
    data = str(write_corpus(tmp_path / "c"))
    for reported in ("exit 143: gbattn: error: terminated at step 85", "killed by SIGKILL: no output",
                     "killed by SIGKILL: step 90"):
        with pytest.raises(UserError) as failed:
            run_compare("cpu-proxy", tmp_path / "cmp", data=data, seeds=[1], sets=sets, only=["standard"], threads=2,
                        jobs=2)
        assert str(failed.value) == (f"1 run(s) failed: standard/seed1 ({reported}); rerun the same command to "
                                     f"retry them")


def test_compare_jobs_divides_the_free_cores_it_measured_once(tmp_path, monkeypatch, capsys):
    """Without --threads, the free cores are measured once (0.2 s of CPU use) and divided between the
    jobs: a second measurement, which on a busy machine can differ, no longer decides the note about
    them (4 cores then 1: each run was given 2 threads while the note said each takes 1)."""
    from gbattn.experiments import compare as compare_mod

    measured, commands, real = itertools.chain([4], itertools.repeat(1)), [], subprocess.Popen
    monkeypatch.setattr(compare_mod, "default_threads", lambda: next(measured))

    def failing_run(cmd, **kwargs):
        commands.append(cmd)
        return real([sys.executable, "-c", "raise SystemExit(3)"], **kwargs)

    monkeypatch.setattr(compare_mod.subprocess, "Popen", failing_run)
    sets = dict(TINY, max_steps=2, eval_every=2, tokenizer="char", batch_size=8, seq_len=32, train_tokens=None,
                eval_tokens=None, warmup_steps=1)
    with pytest.raises(UserError, match="run\\(s\\) failed"):  # (two runs, two at once)
        run_compare("cpu-proxy", tmp_path / "cmp", data=str(write_corpus(tmp_path / "c")), seeds=[1, 2], sets=sets,
                    only=["standard"], jobs=2)
    assert len(commands) == 2 and all("threads=2" in cmd for cmd in commands), commands
    assert "note:" not in capsys.readouterr().err
    # Fewer free cores than jobs: each run takes 1 thread, as the note says (not the default, every core)
    measured = itertools.repeat(1)
    with pytest.raises(UserError, match="run\\(s\\) failed"):
        run_compare("cpu-proxy", tmp_path / "cmp2", data=str(write_corpus(tmp_path / "c")), seeds=[1, 2], sets=sets,
                    only=["standard"], jobs=2)
    assert len(commands) == 4 and all("threads=1" in cmd for cmd in commands[2:]), commands
    assert "each run takes 1 thread, 2 in all" in capsys.readouterr().err


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_comparison_leaves_no_run_training(tmp_path):
    """kill -9 of `compare --jobs 2`: each running child is told (SIGTERM), checkpoints and stops, rather
    than training on unseen with nobody to collect its result."""
    proc, out = _start_endless_comparison(tmp_path)
    pids = []
    try:
        runs = _two_runs_training(proc, out)
        pids = [int((run / rundir.LOCK).read_text().split()[0]) for run in runs]  # each child's lock: its pid first
        assert all(_alive(pid) for pid in pids)
        proc.kill()
        proc.wait()
        assert _all_gone(pids), "a run trains on after its comparison was killed"
        for run in runs:
            events = [json.loads(line)["event"] for line in (run / rundir.METRICS).read_text().splitlines()]
            assert "interrupted" in events, run
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _all_gone(pids: list[int], seconds: float = 60) -> bool:
    """Whether every process of ``pids`` has ended within ``seconds``."""
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(pid) for pid in pids)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


SIGTERMS_DURING_THE_TEST_EVALUATION = textwrap.dedent('''
    import os, signal, time
    from gbattn.errors import Terminated
    from gbattn.parent_death import stop_with_parent
    from gbattn.train.trainer import _sigterm_raises

    stop_with_parent()  # as a torchrun worker: its parent's death sends SIGTERM, once per thread of the parent
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a worker's handler
    try:
        with _sigterm_raises():
            for _ in range(3):
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    except Terminated:
        for _ in range(2):  # the rest of the repeats, while the worker says its line and leaves
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        print("stopped, and said so")
''')


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_repeated_sigterms_during_the_test_evaluation_stop_a_worker_once_with_its_line():
    """A torchrun worker killed with its parent during the final test evaluation gets SIGTERM once per thread of the
    dying torchrun: the first raised Terminated, and the default handler, put back at once, let a repeat end the
    worker silently (exit -15, no line, no result.json). The repeats change nothing once it is stopping."""
    done = subprocess.run([sys.executable, "-c", SIGTERMS_DURING_THE_TEST_EVALUATION], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout) == (0, "stopped, and said so\n"), done


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_torchrun_leaves_no_process_training(tmp_path):
    """kill -9 of torchrun: its workers, each in a session of its own, trained on unseen to the end (holding
    the run directory, so that `train --resume` said it was in use). Each is now sent SIGTERM when torchrun
    dies: together they checkpoint, stop and say how to continue. The kernel sends that SIGTERM once per thread
    of torchrun, and a worker took the second as "stop now": it left mid-step, without the checkpoint, the
    "interrupted" record or its line (7 of 10 runs on a busy 2-core machine)."""
    data = write_corpus(tmp_path / "c", lines_per_split=(60, 20, 20))
    env = dict(os.environ, OMP_NUM_THREADS="1", GBATTN_CACHE=str(tmp_path / "cache"))
    run, err = tmp_path / "run", tmp_path / "err"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([*TORCHRUN, "--out", str(run), *_train_argv(data, 100_000, eval_every=2)],
                                stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    workers = []
    try:
        deadline = time.monotonic() + 300  # a busy machine is slow, not wrong
        while not (run / rundir.CHECKPOINT).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = _children(proc.pid)
        assert len(workers) == 2 and proc.poll() is None, err.read_text()[-3000:]
        proc.kill()
        proc.wait()
        assert _all_gone(workers), "a worker trains on after torchrun was killed"
    finally:
        for pid in [proc.pid] * (proc.poll() is None) + [w for w in workers if _alive(w)]:
            os.kill(pid, signal.SIGKILL)
    step = rundir.load_checkpoint(run / rundir.CHECKPOINT)["step"]
    events = [json.loads(line) for line in (run / rundir.METRICS).read_text().splitlines()]
    assert events[-1] == {"event": "interrupted", "step": step}, (events[-3:], err.read_text()[-3000:])
    assert err.read_text().count(f"gbattn: error: terminated at step {step}; checkpoint saved in {run}") == 2, \
        err.read_text()[-3000:]  # each worker's line


def test_sigterm_during_the_final_test_evaluation_of_a_torchrun_worker_says_how_to_continue(tmp_path):
    """A torchrun worker keeps SIGTERM's default handler (cli leaves it, so processes never wait on each other when
    torchrun terminates them); the training loop catches it, but a SIGTERM during the final test evaluation (torchrun
    killed, a scheduler's stop) ended the worker silently, where one process says its checkpoint is saved and how to
    continue. The real signal, sent to a process whose SIGTERM is the default, as a worker's is, in a process of its
    own (the default handler would end this one)."""
    data = write_corpus(tmp_path / "c")
    run = tmp_path / "run"
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from helpers import tiny_configs
        from gbattn.errors import Interrupted
        from gbattn.train.trainer import Trainer, train
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        original = Trainer._evaluate
        def evaluate(self, split):
            if split == "test":
                os.kill(os.getpid(), signal.SIGTERM)
            return original(self, split)
        Trainer._evaluate = evaluate
        try:
            train({str(run)!r}, *tiny_configs({str(data)!r}, attn="standard", max_steps=2, eval_every=2), quiet=True)
        except Interrupted as e:
            print(e, e.exit_code)
        print("after:", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1", GBATTN_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert done.stdout.splitlines() == [
        f"terminated during the test evaluation after the last step; its checkpoint is saved in {run}: continue with "
        f"`gbattn train --resume --out {files.shell_path(run)}` (it tests again) 143", "after: True"], done.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_torchrun_killed_while_its_workers_import_torch_leaves_none_waiting(tmp_path):
    """kill -9 of torchrun while its workers import torch: they asked for its death signal only on joining the
    process group, so they never received it and waited for torchrun's store instead, retrying for 30 minutes
    (still there 90 s later). They ask for it before importing torch now, and end with torchrun."""
    data = write_corpus(tmp_path / "c", lines_per_split=(60, 20, 20))
    env = dict(os.environ, OMP_NUM_THREADS="1", GBATTN_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen([*TORCHRUN, "--out", str(tmp_path / "run"), *_train_argv(data, 300)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    workers = []

    def importing_torch(pid: int) -> bool:
        try:
            return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            return False

    try:
        deadline = time.monotonic() + 120  # a busy machine is slow, not wrong
        while not (len(workers) == 2 and all(importing_torch(w) for w in workers)) and time.monotonic() < deadline:
            workers = _children(proc.pid)
            time.sleep(0.02)
        assert len(workers) == 2 and proc.poll() is None
        proc.kill()
        proc.wait()
        assert _all_gone(workers), "a worker waits on after torchrun was killed"
    finally:
        for pid in [proc.pid] * (proc.poll() is None) + [w for w in workers if _alive(w)]:
            os.kill(pid, signal.SIGKILL)


GRADIENT_WORKER = textwrap.dedent('''
    """Under torchrun: each process takes half of a global batch; FSDP2's full gradients (rank 0)
    are written for the test to compare with one process on the whole batch."""
    import json, os, sys
    import torch
    import torch.distributed as dist
    from gbattn.config import ModelConfig
    from gbattn.model import GPT
    from gbattn.train.distributed import init_distributed, wrap_model

    cases = json.loads(sys.argv[2])
    env = init_distributed("cpu") if "WORLD_SIZE" in os.environ else None
    out = {}
    for key, cfg_d in cases.items():
        torch.manual_seed(0)
        model = GPT(ModelConfig(**cfg_d))
        idx = torch.randint(0, cfg_d["vocab_size"], (4, 11), generator=torch.Generator().manual_seed(1))
        if env is not None:
            from torch.distributed.fsdp import FSDPModule

            model = wrap_model(model, "fsdp2", env, torch.device("cpu"))
            idx = idx[2 * env.rank : 2 * env.rank + 2]
            # each attention and FFN sublayer its own unit, then the root
            units = [isinstance(m, FSDPModule) for b in model.blocks for m in (b.attn, b.mlp)] + [
                isinstance(model, FSDPModule)]
        model(idx[:, :-1], idx[:, 1:]).backward()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).tolist()
                 for n, p in model.named_parameters() if p.grad is not None}  # AttnRes: sublayer 0 mixes nothing
        out[key] = grads
        if env is not None:
            out["units " + key] = units
    if env is None or env.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    if env is not None:
        dist.destroy_process_group()
''')


def _fsdp_cases() -> dict[str, dict]:
    from conftest import VARIANT_CASES, case_id

    base = dict(vocab_size=23, block_size=16, d_model=16, n_layers=2, n_heads=4, dropout=0.0)
    cases = {case_id(c): dict(base, attn=c[0], attn_options=c[1]) for c in VARIANT_CASES}
    cases["attnres-block-gqa-rope"] = dict(base, attn="boosted", residual="attnres-block", n_kv_heads=2, pos="rope")
    cases["untied-llama"] = dict(base, attn="boosted", norm_type="rmsnorm", ffn="swiglu", bias=False,
                                 tie_embeddings=False)
    return cases


def test_fsdp2_gradients_are_the_single_process_average(tmp_path, monkeypatch):
    worker = tmp_path / "worker.py"
    worker.write_text(GRADIENT_WORKER)
    cases = json.dumps(_fsdp_cases())
    env = dict(os.environ, OMP_NUM_THREADS="1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # the one process, the whole batch: this one (no start-up)
    monkeypatch.setattr(sys, "argv", [str(worker), str(tmp_path / "one.json"), cases])
    runpy.run_path(str(worker), run_name="__main__")
    sharded = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--standalone", str(worker), str(tmp_path / "two.json"), cases],
                             capture_output=True, text=True, env=env)
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    one, two = (json.loads((tmp_path / f).read_text()) for f in ("one.json", "two.json"))
    assert all(all(two["units " + case]) for case in one), {case: two["units " + case] for case in one}
    for case, grads in one.items():
        assert grads.keys() == two[case].keys() and len(grads) > 10, case
        for name, g in grads.items():
            torch.testing.assert_close(torch.tensor(two[case][name]), torch.tensor(g), rtol=1e-4, atol=1e-6,
                                       msg=lambda m, c=case, n=name: f"{c} {n}: {m}")


def _train_argv(data, steps: int, **sets) -> list[str]:
    """A tiny GBA + AttnRes run's train options; ``sets`` replace the --set values (a field given twice is refused)."""
    argv = ["--preset", "paper-small", "--attn", "boosted", "--residual", "attnres-block", "--data", str(data),
            "--tokenizer", "char", "--quiet"]
    values = {"dropout": 0.0, "batch_size": 8, "max_steps": steps, "eval_every": 3, "warmup_steps": 2, "lr": 3e-3,
              "train_tokens": "null", "eval_tokens": "null", "attn.gate": "scalar", **TINY, **sets}
    for k, v in values.items():
        argv += ["--set", f"{k}={v}"]
    return argv


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
            "-m", "gbattn.cli", "train"]
ONE_PROCESS_STEPS = 6
NATIVE_CRASH = re.compile(r"exitcode\s*:\s*-(6|11)\b")  # a process killed by SIGABRT or SIGSEGV


def torchrun(out: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    """``torchrun ... train --out OUT ARGS``, once more if one of its processes died of a native crash. Once, in CI
    on 2026-12-05, a rank of the two gloo FSDP2 processes aborted in glibc ("malloc(): unaligned fastbin chunk
    detected") mid-run; 12 runs of the same test did not repeat it. Such a crash is torch's native code, not
    what these tests check, which every other failure still fails. A fresh run's folder is cleared first."""
    for attempt in (1, 2):
        proc = subprocess.run([*TORCHRUN, "--out", str(out), *args], capture_output=True, text=True, env=env,
                              timeout=900)  # (a process that waits forever for the other fails the test, not CI)
        # (a resumed run goes on from its last checkpoint, exactly: its folder stays)
        if attempt == 2 or proc.returncode == 0 or not crashed_natively(proc.stderr, out, clear="--resume" not in args):
            return proc
    return proc


def crashed_natively(stderr: str, out: Path, clear: bool = True) -> bool:
    """Whether one of a torchrun's processes died of SIGABRT or SIGSEGV (:func:`torchrun`); if so, it says so and
    clears a fresh run's folder ``out`` for the second try."""
    if not NATIVE_CRASH.search(stderr):
        return False
    print(f"torchrun: a process crashed in native code; running it again:\n{stderr[-2000:]}")
    if clear:
        shutil.rmtree(out, ignore_errors=True)
    return True


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory) -> tuple[Path, Path]:
    """The reference that two processes must match: `gbattn train` of _train_argv's run (dropout off) for
    ONE_PROCESS_STEPS steps in one process, trained once for the module. (its corpus, its run directory)"""
    root = tmp_path_factory.mktemp("one-process")
    data = write_corpus(root / "c")
    env = dict(os.environ, OMP_NUM_THREADS="1", GBATTN_CACHE=str(root / "cache"))
    single = subprocess.run([sys.executable, "-m", "gbattn.cli", "train", "--out", str(root / "one"),
                             *_train_argv(data, ONE_PROCESS_STEPS)], capture_output=True, text=True, env=env)
    assert single.returncode == 0, single.stderr
    return data, root / "one"


def test_fsdp2_training_matches_one_process_with_full_checkpoints(tmp_path, one_process_run):
    """2 processes x 4 rows under FSDP2 == 1 process x 8 rows (dropout off), AttnRes, a scalar gate and
    tied embeddings included, with activation checkpointing (each sharded block recomputed in the backward pass);
    the checkpoint holds the full weights, loadable by one process."""
    data, single = one_process_run
    env = dict(os.environ, OMP_NUM_THREADS="1", GBATTN_CACHE=str(tmp_path / "cache"))
    fsdp = torchrun(tmp_path / "two", *_train_argv(data, ONE_PROCESS_STEPS), "--set", "parallel=fsdp2",
                    "--set", "activation_checkpointing=true", env=env)
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    one = json.loads((single / rundir.RESULT).read_text())
    two = json.loads((tmp_path / "two" / rundir.RESULT).read_text())
    assert two["processes"] == 2
    assert two["test_loss"] == pytest.approx(one["test_loss"], rel=1e-4)  # float32 reductions in another order
    a = rundir.load_checkpoint(single / rundir.CHECKPOINT)["model"]
    b = rundir.load_checkpoint(tmp_path / "two" / rundir.CHECKPOINT)["model"]
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)  # full, not sharded
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-5)
    # Resuming the finished run says so once, not once per process.
    again = torchrun(tmp_path / "two", "--resume", env=env)
    assert again.returncode == 0 and again.stdout.count("nothing to resume") == 1, again.stdout


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_an_interrupted_run_of_two_processes_resumes_exactly(tmp_path, parallel):
    """SIGTERM after the first checkpoint: both processes agree on a step, save one full checkpoint and
    stop; the resumed run ends with the weights and losses of an uninterrupted run, dropout on
    (every process resumes its own random stream)."""
    data = write_corpus(tmp_path / "c")
    env = dict(os.environ, OMP_NUM_THREADS="1", GBATTN_CACHE=str(tmp_path / "cache"))
    argv = [*_train_argv(data, 40, parallel=parallel, dropout=0.1)]
    ref = torchrun(tmp_path / "ref", *argv, env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert ref.stdout.count('"test_ppl"') == 1, ref.stdout  # one summary, not one per process
    run = tmp_path / "run"
    for attempt in (1, 2):  # once more after a native crash, as torchrun() does
        proc = subprocess.Popen([*TORCHRUN, "--out", str(run), *argv], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 600  # a busy machine is slow, not wrong
        while not (run / rundir.CHECKPOINT).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None or attempt == 2 or not crashed_natively(proc.communicate()[1], run):
            break
    assert proc.poll() is None and (run / rundir.CHECKPOINT).exists(), "no checkpoint before the run ended"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    # The way to continue is under torchrun again (alone, one process would train on, with another dropout stream).
    assert (f"terminated at step {rundir.load_checkpoint(run / rundir.CHECKPOINT)['step']}; checkpoint saved in {run}: "
            f"continue with `torchrun --nproc_per_node 2 -m gbattn.cli train --resume --out {run}`") in err, err[-3000:]
    state = rundir.load_checkpoint(run / rundir.CHECKPOINT)
    assert 3 <= state["step"] < 40 and not (run / rundir.RESULT).exists(), state["step"]
    resumed = torchrun(run, "--resume", "--quiet", env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = rundir.load_checkpoint(tmp_path / "ref" / rundir.CHECKPOINT)["model"]
    b = rundir.load_checkpoint(run / rundir.CHECKPOINT)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (json.loads((run / rundir.RESULT).read_text())["test_loss"]
            == json.loads((tmp_path / "ref" / rundir.RESULT).read_text())["test_loss"])


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_two_processes_with_gradient_accumulation_match_one_process(tmp_path, one_process_run, parallel):
    """2 processes x 2 micro-batches of 2 rows == 1 process x 8 rows: gradients are reduced once per step,
    after the last micro-batch, and averaged; metrics.jsonl holds the global batch's mean loss, once; the
    checkpoint keeps each process's own random stream (seeded apart: dropout masks differ across processes)."""
    from helpers import train_losses

    data, single = one_process_run
    env = dict(os.environ, OMP_NUM_THREADS="1", GBATTN_CACHE=str(tmp_path / "cache"))
    two = torchrun(tmp_path / "two", *_train_argv(data, ONE_PROCESS_STEPS), "--set", f"parallel={parallel}", "--set",
                   "grad_accum=2", env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    a = rundir.load_checkpoint(single / rundir.CHECKPOINT)["model"]
    b = rundir.load_checkpoint(tmp_path / "two" / rundir.CHECKPOINT)["model"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    one_losses, two_losses = train_losses(single), train_losses(tmp_path / "two")
    assert len(two_losses) == len(one_losses) == ONE_PROCESS_STEPS
    assert two_losses == pytest.approx(one_losses, rel=1e-4)
    streams = rundir.load_checkpoint(tmp_path / "two" / rundir.CHECKPOINT)["rng_per_rank"]
    assert len(streams) == 2 and not torch.equal(streams[0]["torch"], streams[1]["torch"])


def test_a_mistake_only_the_first_process_sees_ends_every_process_with_its_line(tmp_path):
    """Under torchrun the first process alone takes the run directory: an --out that already holds a run
    ends both processes with its one line (exit 2), where the second process used to fail waiting for
    the first with a gloo traceback ("Connection closed by peer"). Each line is one write: torchrun's
    processes write unbuffered, and the two lines were seen run together."""
    data = write_corpus(tmp_path / "c", lines_per_split=(60, 20, 20))
    held = tmp_path / "held"
    held.mkdir()
    (held / rundir.CONFIG).write_text("{}")
    env = dict(os.environ, OMP_NUM_THREADS="1", GBATTN_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([*TORCHRUN, "--out", str(held), *_train_argv(data, 2)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode != 0
    own = [line for line in proc.stderr.splitlines() if line.startswith("gbattn: error:")]
    assert own and set(own) == {f"gbattn: error: {held} already holds a run; pass --resume (from Python: "
                                f"resume=True) to continue it, --restart (restart=True) to replace it, or choose "
                                f"another --out"}, proc.stderr[-3000:]
    assert "[rank" not in proc.stderr and "exitcode: 2" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in held.iterdir()) == [".lock", rundir.CONFIG]


SECOND_RANK_DATA_WORKER = textwrap.dedent('''
    """`gbattn train` under torchrun where the second process alone cannot read the data the first prepared."""
    import os, sys
    from gbattn import cli
    from gbattn.errors import UserError
    from gbattn.train import trainer

    if os.environ["RANK"] == "1":
        def unreadable(*args, **kwargs):
            raise UserError("the second process cannot read the data")

        trainer.prepare_data = unreadable
    sys.exit(cli.main(sys.argv[1:]))
''')


def test_a_mistake_only_the_second_process_sees_ends_every_process_with_its_line(tmp_path):
    """The data is prepared by the first process, then read by the others (DistEnv.main_first): an error the
    second process alone meets there is every process's, so both say its line and exit 2 (the first used to be
    left waiting for the second in a collective until torchrun ended it)."""
    worker = tmp_path / "worker.py"
    worker.write_text(SECOND_RANK_DATA_WORKER)
    data = write_corpus(tmp_path / "c", lines_per_split=(60, 20, 20))
    env = dict(os.environ, OMP_NUM_THREADS="1", GBATTN_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                           str(worker), "train", "--out", str(tmp_path / "run"), *_train_argv(data, 2)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0
    own = [line for line in proc.stderr.splitlines() if line.startswith("gbattn: error:")]
    assert own == ["gbattn: error: the second process cannot read the data"] * 2, proc.stderr[-3000:]


SECOND_RANK_ARGUMENTS_WORKER = textwrap.dedent('''
    """`gbattn train` under torchrun with the second process given other arguments: SECOND_RANK_ARGS (JSON) replaces
    each of its arguments named there by the value given (a job script that launches the ranks differently)."""
    import json, os, sys
    from gbattn import cli

    argv = sys.argv[1:]
    if os.environ["RANK"] == "1":
        argv = [json.loads(os.environ["SECOND_RANK_ARGS"]).get(a, a) for a in argv]
    sys.exit(cli.main(argv))
''')


def test_processes_that_see_other_folders_or_were_given_other_runs_refuse(tmp_path):
    """Only rank 0 writes the checkpoints, which every process reads: a second process that sees another folder as
    --out (nodes without a shared file system) tested its last weights as the best ones, or waited forever; one
    given another learning rate trained on silently (another model: a DDP traceback). Each now ends every process
    with one line, exit 2, before training."""
    worker = tmp_path / "worker.py"
    worker.write_text(SECOND_RANK_ARGUMENTS_WORKER)
    data = write_corpus(tmp_path / "c", lines_per_split=(60, 20, 20))
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    argv = ["train", "--out", str(run), *_train_argv(data, 2)]
    cases = [({str(run): str(elsewhere)},
              f"{run} is not one folder that every process sees: rank 1 (on {socket.gethostname()}, its --out "
              f"{elsewhere}) finds no run of "
              f"rank 0's there; only rank 0 writes the checkpoints and every process reads them, so a run on several "
              f"nodes needs its --out on a file system they share"),
             ({"lr=0.003": "lr=0.5"},
              "the 2 processes were launched with different runs: rank 1's differs from rank 0's in lr; launch "
              "every process with the same command (torchrun --nproc_per_node N -m gbattn.cli train ...)")]
    other = write_corpus(tmp_path / "other", lines_per_split=(70, 20, 20))  # (its own copy, and not the same)
    cases.append(({str(data): str(other)}, f"rank 1 (on {socket.gethostname()}) read another corpus from --data "
                                           f"{other} than rank 0 from --data {data}: every process trains on the same "
                                           f"data; give each node the same copy"))
    # a tokenizer file: a node's own copy at another path trains; another tokenizer is refused
    from gbattn.data.corpus import load_corpus
    from gbattn.data.tokenizer import get_tokenizer

    for name, vocab in (("tk", 80), ("tk-copy", 80), ("tk-other", 60)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(
            get_tokenizer("bpe", load_corpus(str(data)), vocab_size=vocab, verbose=False).payload)
    hf_argv = [a if a != "char" else f"hf={tmp_path / 'tk' / 'tokenizer.json'}" for a in argv]
    cases.append(({f"hf={tmp_path / 'tk' / 'tokenizer.json'}": f"hf={tmp_path / 'tk-other' / 'tokenizer.json'}"},
                  f"rank 1 (on {socket.gethostname()}) has another tokenizer than rank 0 (--tokenizer hf): give each "
                  f"node the same copy of its file (or of --init-from's run)", hf_argv))
    assert "lr=0.003" in argv
    env = dict(os.environ, OMP_NUM_THREADS="1", GBATTN_CACHE=str(tmp_path / "cache"), SECOND_RANK_ARGS=json.dumps(
        {f"hf={tmp_path / 'tk' / 'tokenizer.json'}": f"hf={tmp_path / 'tk-copy' / 'tokenizer.json'}"}))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                           str(worker), *hf_argv], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and (run / rundir.RESULT).is_file(), proc.stderr[-3000:]
    shutil.rmtree(run)
    # ... and of --init-from's run, in a folder of another name (its name, recorded in extra, was compared)
    from gbattn.cli import main as cli_main

    base = tmp_path / "base"
    assert cli_main(["train", *_train_argv(data, 2), "--out", str(base)]) == 0
    shutil.copytree(base, tmp_path / "base-copy")
    start_argv = ["train", "--init-from", str(base), "--out", str(run), "--set", "max_steps=2", "--set",
                  "eval_every=2", "--quiet"]
    env["SECOND_RANK_ARGS"] = json.dumps({str(base): str(tmp_path / "base-copy")})
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                           str(worker), *start_argv], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and (run / rundir.RESULT).is_file(), proc.stderr[-3000:]
    shutil.rmtree(run)
    # ... but a run of other weights there (the same model, another seed) is refused
    assert cli_main(["train", *_train_argv(data, 2), "--seed", "7", "--out", str(tmp_path / "base-other")]) == 0
    cases.append(({str(base): str(tmp_path / "base-other")},
                  f"rank 1 (on {socket.gethostname()}) read other starting weights (--init-from) than rank 0: give "
                  f"each node the same copy of that run", start_argv))
    for replaced, line, *given in cases:
        env = dict(os.environ, OMP_NUM_THREADS="1", GBATTN_CACHE=str(tmp_path / "cache"),
                   SECOND_RANK_ARGS=json.dumps(replaced))
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                               str(worker), *(given[0] if given else argv)], capture_output=True, text=True, env=env,
                              timeout=300)
        own = [text for text in proc.stderr.splitlines() if text.startswith("gbattn: error:")]
        assert proc.returncode != 0 and own == [f"gbattn: error: {line}"] * 2, proc.stderr[-3000:]
        assert not (run / rundir.CHECKPOINT).exists() and not elsewhere.exists()


SKEWED_CLOCK_WORKER = textwrap.dedent('''
    """`gbattn train` under torchrun with the second process's checkpoint clock an hour ahead at every
    reading: it finds a time-based checkpoint due after every step, the first process never."""
    import itertools, os, sys, types
    from gbattn import cli
    from gbattn.train import trainer

    if os.environ["RANK"] == "1":
        hours = itertools.count()
        trainer.time = types.SimpleNamespace(perf_counter=trainer.time.perf_counter,
                                             monotonic=lambda: 3600.0 * next(hours))
    sys.exit(cli.main(sys.argv[1:]))
''')


def test_processes_whose_clocks_disagree_save_time_based_checkpoints_together(tmp_path):
    """checkpoint_minutes is measured on each process's clock, and a checkpoint is a collective (every
    process's random state is gathered): a process that found one due while another did not waited for
    it for ever (every 2-process run with checkpoint_minutes near a step's time hung at its first
    step). Every process now saves when any finds one due: the run ends, checkpointed at its end."""
    worker = tmp_path / "worker.py"
    worker.write_text(SKEWED_CLOCK_WORKER)
    data = write_corpus(tmp_path / "c", lines_per_split=(60, 20, 20))
    env = dict(os.environ, OMP_NUM_THREADS="1", GBATTN_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                             str(worker), "train", "--out", str(tmp_path / "run"),
                             *_train_argv(data, 4, eval_every=100)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # torchrun stops its processes (killing them after 30 s)
        _, err = proc.communicate()
        raise AssertionError(f"the run hung: {err[-2000:]}") from None
    assert proc.returncode == 0, err[-3000:]
    assert rundir.load_checkpoint(tmp_path / "run" / rundir.CHECKPOINT)["step"] == 4


SIGNALLED_RANK_WORKER = textwrap.dedent('''
    """`gbattn train` under torchrun where the second process alone receives SIGTERM, during step 3
    (as `kill` of one process, or a scheduler that signals it, does); it leaves after the first has said
    why it stopped (torchrun then ends it), so that the first process's line and status are seen."""
    import os, signal, sys, time
    from gbattn import cli
    from gbattn.train import distributed
    from gbattn.train.trainer import Trainer

    if os.environ["RANK"] == "1":
        step_once = Trainer._train_step

        def signalled(self, step):
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return step_once(self, step)

        Trainer._train_step = signalled
        leave = distributed.shutdown_distributed
        distributed.shutdown_distributed = lambda: (time.sleep(5), leave())
    sys.exit(cli.main(sys.argv[1:]))
''')


def test_a_signal_to_one_process_stops_every_process_with_that_signals_words_and_status(tmp_path):
    """SIGTERM to the second process alone: every process stops at the same step and says "terminated", with
    SIGTERM's status 143; the first, which received no signal, said "interrupted" and exited 130 (Ctrl-C's
    status), and torchrun named it as the root cause."""
    worker = tmp_path / "worker.py"
    worker.write_text(SIGNALLED_RANK_WORKER)
    data = write_corpus(tmp_path / "c", lines_per_split=(60, 20, 20))
    env = dict(os.environ, OMP_NUM_THREADS="1", GBATTN_CACHE=str(tmp_path / "cache"))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                           str(worker), "train", "--out", str(run), *_train_argv(data, 10)], capture_output=True,
                          text=True, env=env, timeout=300)
    own = [line for line in proc.stderr.splitlines() if line.startswith("gbattn: error:")]
    assert own and set(own) == {f"gbattn: error: terminated at step 3; checkpoint saved in {run}: continue "
                                          f"with `torchrun --nproc_per_node 2 -m gbattn.cli train --resume --out "
                                          f"{run}`"}, proc.stderr[-3000:]
    assert "exitcode  : 143" in proc.stderr and "exitcode  : 130" not in proc.stderr, proc.stderr[-3000:]
    assert rundir.load_checkpoint(run / rundir.CHECKPOINT)["step"] == 3


def test_a_diverged_run_says_to_start_again_as_it_was_launched(tmp_path, monkeypatch):
    """A NaN loss under torchrun said to start again with `gbattn train ... --restart` (one process: slower, with
    FSDP2 perhaps out of memory, another dropout stream), where its resume hint already said torchrun; on several
    machines both hints say the command is each node's."""
    from gbattn.train.distributed import DistEnv
    from gbattn.train.trainer import Trainer
    from helpers import tiny_configs

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    run = tmp_path / "run"
    trainer = Trainer(run, *tiny_configs(write_corpus(tmp_path / "c")))
    trainer.step = 2
    said = {}
    for world in (1, 2):
        trainer.dist = DistEnv(world=world)
        said[world] = trainer._diverged_message("loss became nan")
    prefix = ("loss became nan in step 3, before the first checkpoint: nothing to keep; start again with corrected "
              "settings: ")
    assert said == {1: f"{prefix}gbattn train ... --out {run} --restart",
                    2: f"{prefix}torchrun --nproc_per_node 2 -m gbattn.cli train ... --out {run} --restart"}
    # Two machines of two processes: each node's command, and that it is each node's (the resume hint too)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    trainer.dist = DistEnv(world=4)
    each = " on each node, launched as this run was"
    assert trainer._diverged_message("loss became nan") == f"{said[2]}{each}"
    assert trainer._resume_command() == f"`torchrun --nproc_per_node 2 -m gbattn.cli train --resume --out {run}`{each}"


def test_the_commands_a_run_suggests_quote_its_directory(tmp_path):
    """The resume, start-again and resume-as-it-ran commands a run prints are to be pasted into a shell: a run
    directory with a space in its name said `gbattn train --resume --out my run`, which argparse refuses."""
    import shlex

    from gbattn.train.distributed import DistEnv
    from gbattn.train.trainer import Trainer
    from helpers import tiny_configs

    run = tmp_path / "my run"
    trainer = Trainer(run, *tiny_configs(write_corpus(tmp_path / "c")))
    trainer.step, trainer.saved_processes = 2, 2
    for world in (1, 2):
        trainer.dist = DistEnv(world=world)
        said = [trainer._resume_command().strip("`"), trainer._diverged_message("loss became nan").split(": ")[-1],
                trainer._other_processes_note().split(": ")[-1].strip("`")]
        for command in said:
            words = shlex.split(command)
            assert words[words.index("--out") + 1] == str(run), command


def test_the_stop_signal_is_sigterm_where_any_process_received_one():
    """The signal every process reports is the same: SIGTERM where any received one (a scheduler's stop
    wins over a Ctrl-C), else SIGINT; a process that received none takes the others'."""
    from types import SimpleNamespace

    from gbattn.train.trainer import Trainer

    def stop_signal(received):
        trainer = SimpleNamespace(dist=SimpleNamespace(gather=lambda _: received))
        return Trainer._stop_signal(trainer, SimpleNamespace(requested=True, signum=received[0]))

    assert stop_signal([signal.SIGINT, signal.SIGTERM]) == signal.SIGTERM
    assert stop_signal([signal.SIGTERM, signal.SIGINT]) == signal.SIGTERM
    assert stop_signal([None, signal.SIGINT]) == signal.SIGINT
    assert stop_signal([None, signal.SIGTERM]) == signal.SIGTERM
    assert stop_signal([signal.SIGINT, signal.SIGUSR1, signal.SIGHUP]) == signal.SIGUSR1  # SLURM's --signal
    assert stop_signal([signal.SIGHUP, signal.SIGTERM]) == signal.SIGTERM


@pytest.mark.parametrize(("world", "code", "message"), [
    ("", 0, ""),  # a job script's empty export: one process
    ("two", 2, "gbattn: error: WORLD_SIZE='two' in the environment is not a number of processes (torchrun sets "
               "it): unset it to run in one process\n"),
    (" ", 0, ""),  # blank is empty
    ("0", 2, "gbattn: error: WORLD_SIZE='0' in the environment is not a number of processes (torchrun sets "
             "it): unset it to run in one process\n"),
])
def test_a_world_size_not_a_number_is_one_line_for_every_command(monkeypatch, capsys, world, code, message):
    """Every command reads WORLD_SIZE (to refuse torchrun): an empty or bad one was a traceback, `gbattn list` too."""
    from helpers import run_cli

    monkeypatch.setenv("WORLD_SIZE", world)
    got, out, err = run_cli(capsys, ["list"])
    assert (got, err) == (code, message)
    assert bool(out) == (code == 0)


@pytest.mark.parametrize(("variables", "wrong"), [
    ({}, "no RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
    ({"RANK": "x", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"},
     "RANK='x' and LOCAL_RANK='0', not both process numbers below it"),
    ({"RANK": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"},
     "RANK='2' and LOCAL_RANK='0', not both process numbers below it"),  # ranks of 2 processes are 0 and 1
    ({"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": " ", "MASTER_PORT": "29500"}, "no MASTER_ADDR"),  # blank: unset
])
def test_a_world_size_without_the_rest_of_torchrun_is_one_line(tmp_path, monkeypatch, capsys, variables, wrong):
    """`gbattn train` with WORLD_SIZE=2 exported but not started by torchrun (or with a rank that is not a number) was
    torch's traceback from joining the process group; now one line, status 2, nothing written."""
    from helpers import run_cli

    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in dict(variables, WORLD_SIZE="2").items():
        monkeypatch.setenv(name, value)
    # (joining a group these variables describe would wait for peers that never come: fail at once instead)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: pytest.fail("joined a process group"))
    data = write_corpus(tmp_path / "c")
    code, out, err = run_cli(capsys, ["train", "--out", tmp_path / "run", *_train_argv(data, 2)])
    assert (code, out) == (2, "")
    assert err == (f"gbattn: error: WORLD_SIZE=2 in the environment, but {wrong}: torchrun sets them all for each "
                   f"process it starts (torchrun --nproc_per_node N -m gbattn.cli train ...); unset WORLD_SIZE to "
                   f"train in one process\n")
    assert not (tmp_path / "run").exists()


def test_torchruns_variables_join_one_group_with_this_machines_gpu_index(monkeypatch):
    """With all that torchrun sets, init_distributed asks to stop with torchrun, joins no second group where one is
    joined already, and takes the GPU index (local_rank) from LOCAL_RANK, the rank and the world from the group:
    process 3 of 4 is GPU 1 of its machine. The group here is a one-process gloo group, joined beforehand."""
    import torch.distributed as dist

    from gbattn.train import distributed

    asked = []
    monkeypatch.setattr(distributed, "stop_with_parent", lambda: asked.append("stop with torchrun"))
    for name, value in {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "localhost",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        env = distributed.init_distributed("cpu")
    finally:
        dist.destroy_process_group()
    assert env == distributed.DistEnv(rank=0, local_rank=1, world=1) and asked == ["stop with torchrun"]


def test_a_mistake_of_this_process_is_raised_as_itself():
    """main_only and main_first raise this process's own error (its type and traceback: a TrainingDiverged, a
    DataNotFound), not a UserError copied from its message as another process's is."""
    from gbattn.errors import DataNotFound
    from gbattn.train.distributed import DistEnv

    error = DataNotFound("no corpus here")

    def fail():
        raise error

    for share in (DistEnv().main_only, DistEnv().main_first):
        with pytest.raises(DataNotFound) as raised:
            share(fail)
        assert raised.value is error


def test_a_mistake_one_process_finds_is_every_processs_with_its_line_and_status():
    """raise_together sends this process's error as its line and exit status; a process that found nothing raises
    the line another found with that status (a diverged loss's 3, not a UserError's 2). Here the first of two
    processes finds the loss diverged, the second nothing: each sees what the other sends."""
    from gbattn.train.distributed import DistEnv
    from gbattn.train.trainer import TrainingDiverged

    class OneOfTwo(DistEnv):
        def gather(self, obj) -> list:
            sent.append(obj)
            return [("loss became nan at step 2", 3), obj]

    sent = []
    with pytest.raises(TrainingDiverged):
        OneOfTwo(rank=0, world=2).raise_together(TrainingDiverged("loss became nan at step 2"))
    with pytest.raises(UserError) as raised:
        OneOfTwo(rank=1, world=2).raise_together(None)
    assert sent == [("loss became nan at step 2", 3), None]
    assert (str(raised.value), raised.value.exit_code) == ("loss became nan at step 2", 3)


def test_main_first_works_on_the_first_process_then_on_the_others_all_joining_each_collective():
    """main_first (the data: prepared by the first process, read by the others) is two collectives that every
    process joins, the first process working before the first, the others between the two, each passing on its
    error instead of raising it alone (which left the other processes waiting). Here each process of two is run
    alone, its peer taken to send what it sends."""
    from gbattn.train.distributed import DistEnv

    class OneOfTwo(DistEnv):
        def gather(self, obj) -> list:
            events.append(("collective", obj))
            return [obj] * self.world

    def work():
        events.append("work")
        if failing:
            raise UserError("no data")
        return "data"

    said = ("no data", 2)
    for rank, failing, expected in (
            (0, False, ["work", ("collective", None), ("collective", None)]),
            (1, False, [("collective", None), "work", ("collective", None)]),
            (0, True, ["work", ("collective", said)]),
            (1, True, [("collective", None), "work", ("collective", said)])):
        events = []
        try:
            got = OneOfTwo(rank=rank, world=2).main_first(work)
        except UserError as e:
            got = str(e)
        assert (got, events) == ("no data" if failing else "data", expected), (rank, failing)


def test_a_run_resumed_on_another_number_of_processes_says_it_is_not_exact(tmp_path, monkeypatch, capsys):
    """A checkpoint of 2 processes resumed in one: the run went on and said 'redone, exactly', yet rank 1's dropout
    stream and the two-way gradient sum are gone (a 2-process DDP run killed at step 5 and resumed alone ended at
    valid ppl 13.535, the uninterrupted one at 13.513). It now warns, on stderr, and says how to continue exactly."""
    from gbattn.train.trainer import train
    from helpers import tiny_configs, train_killed_at

    data = write_corpus(tmp_path / "c")
    run = tmp_path / "run"
    train_killed_at(5, run, *tiny_configs(data), monkeypatch)
    state = rundir.load_checkpoint(run / rundir.CHECKPOINT)
    state["rng_per_rank"] = [state["rng_per_rank"][0], state["rng_per_rank"][0]]  # as 2 processes save it
    state["most_processes"] = 2
    rundir.save_checkpoint(state, run / rundir.CHECKPOINT)
    capsys.readouterr()
    result = train(run, resume=True)
    printed = capsys.readouterr()
    # result.json's processes: the most any leg trained in (it said the last leg's, 1)
    assert result["processes"] == 2 and rundir.read_result(run / rundir.RESULT)["processes"] == 2
    assert "resuming at step 4 of 12, the last checkpoint (work after it is redone)\n" in printed.out
    assert (f"warning: the checkpoint of {run} holds the random streams of 2 processes and this run has 1: it goes "
            f"on, but not exactly as the uninterrupted run would") in printed.err
    assert f"resume as it ran: `torchrun --nproc_per_node 2 -m gbattn.cli train --resume --out {run}`" in printed.err


def test_a_process_the_checkpoint_holds_no_stream_of_draws_a_stream_of_its_own(tmp_path, monkeypatch):
    """A one-process checkpoint resumed by two processes: the first resumes the saved stream, the second
    (which the checkpoint holds none of) one of its own, the same on every resume, not the first's (with
    dropout, both processes would draw the same masks on their halves of a batch), nor its own at step 0 (it would
    draw the masks of the run's first steps again). _load runs here as each process of two would run it."""
    from gbattn.train.distributed import DistEnv
    from gbattn.train.trainer import Trainer
    from helpers import tiny_configs, train_killed_at

    data = write_corpus(tmp_path / "c")
    run = tmp_path / "run"
    train_killed_at(5, run, *tiny_configs(data), monkeypatch)
    saved = rundir.load_checkpoint(run / rundir.CHECKPOINT)["rng_per_rank"]
    assert len(saved) == 1
    trainer = Trainer(run, resume=True, quiet=True)
    trainer._setup()
    trainer.lock.release()
    streams = {}
    for rank in (0, 1, 1):
        trainer.dist = DistEnv(rank=rank, world=2)
        trainer._load(rundir.load_checkpoint(run / rundir.CHECKPOINT), run / rundir.CHECKPOINT)
        state = torch.get_rng_state()
        assert streams.setdefault(rank, state).equal(state)  # the same stream on every resume
    assert torch.equal(streams[0], saved[0]["torch"]) and not torch.equal(streams[1], streams[0])
    torch.manual_seed(trainer.train_cfg.seed + 1000)  # rank 1's stream at the start of a 2-process run
    assert not torch.equal(streams[1], torch.get_rng_state())  # (it would draw step 0's masks again)


def test_gradient_accumulation_reduces_gradients_once_per_step():
    """Under DDP every micro-step but the last runs in the model's no_sync() (the gradients are all-reduced
    once, after the last); under FSDP2 gradient sync is turned off for those micro-steps and on again for
    the last; in one process nothing is changed. (The results match either way: this is the all-reduces.)"""
    import contextlib

    from gbattn.train.distributed import DistEnv

    class Model:
        def __init__(self):
            self.calls = []

        def no_sync(self):
            self.calls.append("no_sync")
            return contextlib.nullcontext()

        def set_requires_gradient_sync(self, flag):
            self.calls.append(flag)

    for world, parallel, expected in ((2, "ddp", ["no_sync", "no_sync"]), (2, "fsdp2", [False, False, True]),
                                      (1, "ddp", []), (1, "fsdp2", [])):
        model = Model()
        for micro in range(3):
            with DistEnv(world=world).no_sync(model, micro == 2, parallel):
                pass
        assert model.calls == expected, (world, parallel, model.calls)


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize(("sets", "processes", "error"), [
    ({"batch_size": 7}, 2, "batch_size=7 must be divisible by processes x grad_accum = 2 x 1"),
    ({"train_tokens": 40}, 1, "the train split of --data .* has 40 tokens: fewer than one batch"),
])
def test_a_restart_that_fails_its_checks_leaves_the_old_run(tmp_path, monkeypatch, sets, processes, error):
    """--restart discarded the run in --out before the new one was checked: under torchrun a batch size the
    processes do not divide (or, in one process, too little data) then failed with the old run already deleted
    (--out held only its lock). The old run is now discarded only once the new one has passed its checks."""
    from gbattn.train import trainer as trainer_module
    from helpers import tiny_configs

    data = write_corpus(tmp_path / "c")
    run = tmp_path / "run"
    trainer_module.train(run, *tiny_configs(data, max_steps=2, eval_every=2), quiet=True)
    before = {name: content for name, content in _snapshot(run).items() if name != rundir.LOCK}
    pose_as_peer(monkeypatch, 0, processes)
    with pytest.raises(UserError, match=error):
        trainer_module.Trainer(run, *tiny_configs(data, max_steps=2, eval_every=2, **sets), quiet=True,
                               restart=True).run()
    assert {name: content for name, content in _snapshot(run).items() if name != rundir.LOCK} == before


def test_a_process_other_than_the_first_writes_and_prints_nothing(tmp_path, monkeypatch, capsys):
    """Under torchrun the first process alone writes the run directory and reports: here this process is
    the second of two (the first of a second machine: local rank 0), its peer's sums and gathers taken as
    its own, on a one-process gloo group. A new run and a resumed one (whose checkpoint holds one process's
    streams: a warning, the first process's to give) create, change and print nothing, and `train --resume` of a
    finished run prints neither that it finished nor its summary."""
    import torch.distributed as dist

    from gbattn.train import trainer as trainer_module
    from helpers import run_cli, tiny_configs, train_killed_at

    data = write_corpus(tmp_path / "c")
    model_cfg, train_cfg = tiny_configs(data, max_steps=4, eval_every=2, warmup_steps=5)  # a warning: warmup > run
    resumed = tmp_path / "resumed"
    train_killed_at(3, resumed, *tiny_configs(data, max_steps=4, eval_every=2), monkeypatch)
    finished = tmp_path / "finished"
    trainer_module.train(finished, *tiny_configs(data, max_steps=2, eval_every=2), quiet=True)
    before, finished_before = _snapshot(resumed), _snapshot(finished)
    capsys.readouterr()
    pose_as_peer(monkeypatch, 1, 2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_cli(capsys, ["train", "--resume", "--out", finished]) == (0, "", "")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        new = trainer_module.Trainer(tmp_path / "new", model_cfg, train_cfg).run()
        again = trainer_module.Trainer(resumed, resume=True).run()
    finally:
        dist.destroy_process_group()
    assert new["steps"] == again["steps"] == 4
    assert not (tmp_path / "new").exists()
    assert _snapshot(resumed) == before and _snapshot(finished) == finished_before
    assert capsys.readouterr() == ("", "")


def test_every_process_starts_from_the_same_weights_and_draws_its_own_dropout_stream(tmp_path, monkeypatch):
    """Every process builds the same initial weights (the seed), then seeds a random stream of its own for dropout
    (seed + 1000 x rank): processes sharing one stream would drop the same units on their parts of each batch.
    _setup runs here as the first and the second of two processes run it, on a one-process gloo group."""
    import torch.distributed as dist

    from gbattn.train import trainer as trainer_module
    from helpers import tiny_configs

    data = write_corpus(tmp_path / "c")
    weights, streams = {}, {}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for rank in (0, 1):
            pose_as_peer(monkeypatch, rank, 2)
            trainer = trainer_module.Trainer(tmp_path / "run", *tiny_configs(data), quiet=True)
            trainer._setup()
            if getattr(trainer, "lock", None) is not None:
                trainer.lock.release()
            weights[rank], streams[rank] = trainer.model.state_dict(), torch.get_rng_state()
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    assert not torch.equal(streams[0], streams[1])


def test_torchrun_helper_runs_again_only_after_a_native_crash(tmp_path, monkeypatch):
    """The helper above retries a run one of whose processes died of SIGABRT or SIGSEGV, once, in a cleared folder;
    a run that failed otherwise (a Python error, exit status 1) is returned as it is, for the test to fail on."""
    calls = []

    def fake_run(argv, **kwargs):
        calls.append(argv)
        (tmp_path / "out").mkdir(exist_ok=True)
        (tmp_path / "out" / "left.txt").write_text("a crashed run's file")
        status, err = script.pop(0)
        return subprocess.CompletedProcess(argv, status, "", err)

    monkeypatch.setattr(subprocess, "run", fake_run)
    script = [(1, "exitcode  : -6 (pid: 1)  (SIGABRT)"), (0, "")]
    monkeypatch.setattr(shutil, "rmtree", lambda path, ignore_errors: calls.append(("cleared", Path(path).name)))
    assert torchrun(tmp_path / "out", "--quiet", env={}).returncode == 0
    assert [c for c in calls if isinstance(c, tuple)] == [("cleared", "out")] and len(calls) == 3
    calls.clear()
    script = [(1, "exitcode  : 1 (pid: 1)\nValueError: ...")]
    assert torchrun(tmp_path / "out", "--quiet", env={}).returncode == 1 and len(calls) == 1
    calls.clear()
    script = [(1, "exitcode  : -11 (pid: 1)"), (1, "exitcode  : -11 (pid: 1)")]
    assert torchrun(tmp_path / "out", "--resume", env={}).returncode == 1 and len(calls) == 2  # once more, not cleared


def test_two_processes_test_the_best_weights_when_the_best_step_is_not_the_last(tmp_path, one_process_run):
    """A run whose validation is best before its last step (lr 3: it diverges) tests best.pt's weights, in every
    process: with rank 1 testing its last weights, result.json's test loss mixed two models (216.2, where best.pt
    scores 149.8 and the last weights 287.5), and every torchrun test had its best step at its last."""
    data, _ = one_process_run
    env = dict(os.environ, OMP_NUM_THREADS="1", GBATTN_CACHE=str(tmp_path / "cache"))
    run = tmp_path / "two"
    proc = torchrun(run, *_train_argv(data, 12, lr=3.0, eval_every=2), "--set", "parallel=ddp", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = rundir.read_result(run / rundir.RESULT)
    assert result["best_step"] < result["steps"] == 12, result["best_step"]
    scored = subprocess.run([sys.executable, "-m", "gbattn.cli", "eval", str(run), "--threads", "1"],
                            capture_output=True, text=True, env=env)  # best.pt, in one process
    assert scored.returncode == 0, scored.stderr
    best = json.loads(scored.stdout.splitlines()[-1])
    assert best["checkpoint"] == "best" and result["test_loss"] == pytest.approx(best["loss"], rel=1e-5)


def test_sums_across_processes_are_float64_and_fsdp2_on_cuda_reduces_in_float32(monkeypatch):
    """DistEnv.all_sum adds evaluation sums, token counts and training losses in float64: in float32 a count of
    16,777,217 tokens came back 16,777,216 and a loss of 4.123456789 as 4.1234569550. FSDP2's policy on a CUDA device
    with bf16 computes in bf16 and reduces gradients in float32, on every sharded unit (never run by another test:
    no GPU), unless amp=off; on a CPU it is the default one. On a one-process gloo group, standing in for two."""
    import torch.distributed as dist

    from gbattn.config import ModelConfig
    from gbattn.model import GPT
    from gbattn.train.distributed import DistEnv, wrap_model

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert DistEnv(world=2).all_sum([16_777_217.0, 4.123456789]) == [16_777_217.0, 4.123456789]
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
        cuda = torch.device("cuda", 0)
        for device, amp, dtypes in ((cuda, "auto", (torch.bfloat16, torch.float32)),
                                    (cuda, "bf16", (torch.bfloat16, torch.float32)),
                                    (cuda, "off", (None, None)),  # (amp=off: bf16 parameters all the same)
                                    (torch.device("cpu"), "auto", (None, None))):
            model = GPT(ModelConfig(vocab_size=20, block_size=8, d_model=16, n_layers=1, n_heads=2))
            wrap_model(model, "fsdp2", DistEnv(world=2), device, amp)
            for unit in (model, model.blocks[0].attn, model.blocks[0].mlp):
                policy = unit._get_fsdp_state()._mp_policy
                assert (policy.param_dtype, policy.reduce_dtype) == dtypes, (device, unit)
    finally:
        dist.destroy_process_group()


def test_the_note_of_a_one_process_checkpoint_resumed_by_two_names_one_process(tmp_path):
    """The warning of a one-process checkpoint resumed under torchrun by two: "of 1 process", and how to resume it
    as it ran (one process, no torchrun). Only the other way round (2 resumed by 1) was checked."""
    from gbattn.train.distributed import DistEnv
    from gbattn.train.trainer import Trainer

    trainer = object.__new__(Trainer)
    trainer.run_dir, trainer.saved_processes, trainer.dist = tmp_path / "run", 1, DistEnv(rank=0, world=2)
    assert trainer._other_processes_note() == (
        f"warning: the checkpoint of {tmp_path / 'run'} holds the random streams of 1 process and this run has 2: it "
        f"goes on, but not exactly as the uninterrupted run would (gradients add up in another order, and a process "
        f"without its own stream draws other dropout masks); to continue exactly, resume as it ran: `gbattn train "
        f"--resume --out {tmp_path / 'run'}` (one process)")


def test_a_process_of_a_second_machine_takes_its_global_ranks_stream_rows_and_evaluation_rows(tmp_path, monkeypatch):
    """Under torchrun on several machines a process's rank (global) and local rank (on its machine) differ: the first
    process of the second of two one-process machines (rank 1, local rank 0) resumes rank 1's random stream, trains
    on the second half of each batch and evaluates rows 1, 3, ...; by its local rank it would take rank 0's stream,
    rows and dropout masks (and count some evaluation rows twice). A checkpoint of two streams resumed by one process
    takes rank 0's."""
    import numpy as np

    from gbattn.config import ModelConfig
    from gbattn.eval.perplexity import evaluate
    from gbattn.model.gpt import GPT
    from gbattn.train.distributed import DistEnv
    from gbattn.train.trainer import Trainer, train
    from helpers import tiny_configs

    data = write_corpus(tmp_path / "c")
    run = tmp_path / "run"
    train(run, *tiny_configs(data, max_steps=4, eval_every=2, threads=1, dropout=0.0), quiet=True)
    state = rundir.load_checkpoint(run / rundir.CHECKPOINT)
    first = state["rng_per_rank"][0]
    torch.manual_seed(12345)
    second = dict(first, torch=torch.get_rng_state())
    state["rng_per_rank"] = [first, second]  # two processes' streams, as they save them
    state["most_processes"] = 2
    rundir.save_checkpoint(state, run / rundir.CHECKPOINT)
    trainer = Trainer(run, resume=True, quiet=True)
    trainer._setup()
    trainer.lock.release()
    for dist_env, stream in ((DistEnv(rank=1, local_rank=0, world=2), second), (DistEnv(rank=0, world=1), first)):
        trainer.dist = dist_env
        trainer._load(rundir.load_checkpoint(run / rundir.CHECKPOINT), run / rundir.CHECKPOINT)
        assert torch.equal(torch.get_rng_state(), stream["torch"]), dist_env
    # its rows of a batch of 8: 4..7
    x_BT, _ = trainer._global_batch(0)
    seen, inner = [], trainer.step_model
    monkeypatch.setattr(trainer, "step_model", lambda xs, ys: seen.append(xs.clone()) or inner(xs, ys))
    trainer.dist = DistEnv(rank=1, local_rank=0, world=2)
    monkeypatch.setattr(trainer.dist, "all_sum", lambda values: [2 * v for v in values])
    trainer.micro_batch = 4
    trainer._train_step(0)
    assert len(seen) == 1 and torch.equal(seen[0], x_BT[4:8])

    class SecondMachinesFirst(DistEnv):  # its own sums: what it scored alone
        def all_sum(self, values):
            return values

    model = GPT(ModelConfig(vocab_size=11, block_size=8, d_model=16, n_layers=1, n_heads=2, dropout=0.0)).eval()
    tokens = np.random.default_rng(0).integers(0, 11, size=2 * 9).astype(np.uint16)  # two rows of 8 + 1
    own = evaluate(model, tokens, seq_len=8, batch_size=1, dist_env=SecondMachinesFirst(rank=1, local_rank=0, world=2))
    assert own.loss == pytest.approx(evaluate(model, tokens[9:18], seq_len=8).loss, abs=1e-6)  # row 1, not row 0


def test_a_one_process_checkpoint_resumed_by_two_processes_says_it_is_not_exact(tmp_path, monkeypatch, capsys):
    """More processes than the checkpoint's (one process's streams, resumed as rank 0 of 2): warned as fewer are, and
    the plan does not say the work after the checkpoint is redone exactly."""
    import torch.distributed as dist

    from gbattn.train import trainer as trainer_module
    from helpers import tiny_configs

    data = write_corpus(tmp_path / "c")
    run = tmp_path / "run"
    trainer_module.train(run, *tiny_configs(data, max_steps=4, eval_every=2, threads=1), quiet=True)
    capsys.readouterr()
    pose_as_peer(monkeypatch, 0, 2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = trainer_module.Trainer(run, resume=True)
        trainer._setup()
        trainer.lock.release()
    finally:
        dist.destroy_process_group()
    printed = capsys.readouterr()
    assert "(work after it is redone)" in printed.out and "exactly" not in printed.out
    assert f"the checkpoint of {run} holds the random streams of 1 process and this run has 2" in printed.err
