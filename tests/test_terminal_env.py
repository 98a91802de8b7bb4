"""The terminal environment and its process sandbox (issue 24): tasks pass and fail as their tests say,
the shell persists across turns, and the limits hold -- a fork bomb, an infinite loop, a 100 MB output
and a network attempt each get cut off while the episode goes on; the sandbox is gone afterwards."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from titan_rl_ext.rl.envs.sandbox import Sandbox, SandboxLimits, _user_tasks, network_isolation_problem
from titan_rl_ext.rl.envs.terminal import TerminalEnv, TerminalTask, load_tasks, toy_tasks
from titan_rl_ext.rl.rollout import ENV_TOKEN_VERSION, rollout_episode
from titan_rl_ext.rl.samples import Generation, SamplingConfig

if network_isolation_problem():
    pytest.skip(f"this machine cannot isolate a sandbox's network: {network_isolation_problem()}",
                allow_module_level=True)

LIMITS = SandboxLimits(command_timeout_s=3.0, max_output_bytes=2048, max_processes=32)


class ByteTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")


class ScriptedGenerator:
    def __init__(self, turns: list[str]) -> None:
        self.turns = list(turns)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> Generation:
        ids = list(self.turns.pop(0).encode())
        return Generation(ids, [-0.1] * len(ids), [3] * len(ids), "stop")


def _episode(task: TerminalTask, turns: list[str], **kw: object) -> tuple[object, TerminalEnv]:
    env = TerminalEnv(ByteTokenizer(), LIMITS, **kw)  # type: ignore[arg-type]
    sample = asyncio.run(rollout_episode(ScriptedGenerator(turns), env, task, SamplingConfig(), max_turns=64))
    return sample, env


def test_task_folders_are_checked(tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "instruction.md").write_text("do it")
    with pytest.raises(ValueError, match="no test.sh"):
        TerminalTask.load(tmp_path / "t")
    with pytest.raises(ValueError, match="no instruction.md"):
        (tmp_path / "u").mkdir()
        (tmp_path / "u" / "test.sh").write_text("true")
        TerminalTask.load(tmp_path / "u")
    with pytest.raises(FileNotFoundError, match="not a folder"):
        TerminalTask.load(tmp_path / "missing")
    assert [t.name for t in toy_tasks()] == ["fix_script", "hello_file", "sum_numbers"]
    with pytest.raises(ValueError, match="no task folders"):
        load_tasks(tmp_path / "t")


@pytest.mark.parametrize("name,turns,reward", [
    ("hello_file", ["<bash>echo 'hello world' > hello.txt</bash>", "Done."], 1.0),
    ("hello_file", ["<bash>echo 'hello' > hello.txt</bash>", "Done."], 0.0),
    ("hello_file", ["I refuse."], 0.0),  # no command: the test judges the untouched sandbox
    ("sum_numbers", ["<bash>paste -sd+ numbers.txt | bc > sum.txt || awk '{s+=$1} END {print s}' numbers.txt > sum.txt"
                     "</bash>", "<bash>cat sum.txt</bash>", "ok"], 1.0),
    ("sum_numbers", ["<bash>wc -l < numbers.txt > sum.txt</bash>", "ok"], 0.0),
    ("fix_script", ["<bash>sed -i 's/\\$2/$1/' greet.sh</bash>", "fixed"], 1.0),
    ("fix_script", ["<bash>cat greet.sh</bash>", "looks fine"], 0.0),
])
def test_tasks_pass_and_fail_as_their_tests_say(name: str, turns: list[str], reward: float) -> None:
    task = {t.name: t for t in toy_tasks()}[name]
    sample, env = _episode(task, turns)
    assert sample.reward == reward, (env.end_reason, env.test_output)  # type: ignore[attr-defined]
    assert env.end_reason == "finished" and env.sandbox is None


def test_observations_carry_no_loss_and_the_shell_persists() -> None:
    task = toy_tasks()[1]
    sample, env = _episode(task, ["<bash>mkdir sub && cd sub && export X=41</bash>",
                                  "<bash>echo $((X+1)) > ../v.txt; pwd</bash>", "<bash>cat ../v.txt</bash>", "end"])
    text = ByteTokenizer().decode(sample.completion_ids)  # type: ignore[attr-defined]
    assert "/sub\n" in text and "\n<output>\n42\n\n[exit code 0]\n</output>\n" in text
    for i, (m, v) in enumerate(zip(sample.loss_mask, sample.token_versions)):  # type: ignore[attr-defined]
        assert (v == ENV_TOKEN_VERSION) == (not m), i
    assert sample.num_turns == 4 and env.end_reason == "finished"  # type: ignore[attr-defined]


def test_limits_cut_off_and_the_episode_goes_on() -> None:
    async def run() -> None:
        sb = Sandbox(LIMITS)
        await sb.start()
        root = sb.root
        try:
            t = time.monotonic()
            r = await sb.run("while true; do :; done")
            assert r.exit_code is None and "timed out after 3 s" in r.output and time.monotonic() - t < 6
            assert (await sb.run("echo alive")).output == "alive\n"

            r = await sb.run("head -c 100000000 /dev/zero | tr '\\0' a; echo; echo tail-end")
            assert r.exit_code == 0 and r.truncated and len(r.output) < 2 * LIMITS.max_output_bytes
            assert r.output.startswith("aaaa") and r.output.rstrip().endswith("tail-end") and "bytes cut" in r.output

            r = await sb.run("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)\"")
            assert r.exit_code != 0 and "unreachable" in r.output, r.output

            for cmd in ("exit 7", "sleep 100 & exit 3"):  # the second leaves a job holding the pipe open
                t = time.monotonic()
                r = await sb.run(cmd)
                assert r.exit_code is None and "the shell exited" in r.output and time.monotonic() - t < 2, r
            assert (await sb.run("echo back")).output == "back\n"

            await sb.run(":(){ :|:& };:")  # the bomb backgrounds itself: the command returns
            await asyncio.sleep(1.0)
            if sb.uid is not None:  # its own uid: the limit counts this episode's processes only
                assert _user_tasks(sb.uid) <= LIMITS.max_processes
            # may time out while the bomb holds every slot; each time-out's restart kills the uid's processes
            # (and on a loaded 2-core CI machine the reaping of the killed ones can take more than one round)
            for _ in range(4):
                r = await sb.run("echo survived")
                if r.exit_code is not None:
                    break
            assert "survived" in r.output
        finally:
            uid = sb.uid
            await sb.close()
        assert not root.exists()
        deadline = time.monotonic() + 5
        while uid is not None and _user_tasks(uid) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # SIGKILLed processes take a moment to be reaped
        if uid is not None:
            assert _user_tasks(uid) == 0  # nothing it started outlives it
    asyncio.run(run())


def test_commands_do_not_block_other_episodes() -> None:
    async def run() -> tuple[int, float]:
        sb = Sandbox(LIMITS)
        await sb.start()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        tick = asyncio.create_task(ticker())
        t = time.monotonic()
        try:
            await sb.run("sleep 1")
        finally:
            tick.cancel()
            await sb.close()
        return ticks, time.monotonic() - t

    ticks, took = asyncio.run(run())
    assert took >= 1.0 and ticks >= 10  # the loop kept turning while the command ran


def test_a_crashed_sandbox_ends_only_its_episode() -> None:
    async def run() -> list[object]:
        task = toy_tasks()[1]
        good = TerminalEnv(ByteTokenizer(), LIMITS)
        bad = TerminalEnv(ByteTokenizer(), LIMITS)

        async def broken(command: str) -> None:
            raise OSError("sandbox vanished")

        async def bad_episode() -> object:
            bad.reset(task)
            await bad._open()
            assert bad.sandbox is not None
            bad.sandbox.run = broken  # type: ignore[method-assign]
            return await bad.step(list(b"<bash>ls</bash>"))

        gen = ScriptedGenerator(["<bash>echo 'hello world' > hello.txt</bash>", "done"])
        return list(await asyncio.gather(bad_episode(), rollout_episode(gen, good, task, SamplingConfig())))

    bad_result, good_sample = asyncio.run(run())
    assert bad_result == (None, 0.0, True)
    assert good_sample.reward == 1.0  # type: ignore[attr-defined]


def test_open_with_command_makes_the_first_turn_a_command() -> None:
    task = {t.name: t for t in toy_tasks()}["hello_file"]
    env = TerminalEnv(ByteTokenizer(), LIMITS, open_with_command=True)
    sample = asyncio.run(rollout_episode(ScriptedGenerator(["echo 'hello world' > hello.txt</bash>", "done"]), env,
                                         task, SamplingConfig()))
    assert ByteTokenizer().decode(sample.prompt_ids).endswith("<bash>")  # type: ignore[attr-defined]
    assert sample.reward == 1.0 and sample.num_turns == 2  # type: ignore[attr-defined]


def test_sandbox_uids_are_distinct_across_processes() -> None:
    """Two processes on one host (two trainers, or a test run beside one) never share a sandbox uid: the
    process limit and the kill at the end are per uid."""
    import subprocess
    import sys

    from titan_rl_ext.rl.envs.sandbox import _take_uid

    if os.geteuid() != 0:
        pytest.skip("sandboxes get their own uid only as root")
    holder = subprocess.Popen([sys.executable, "-c", "import time; from titan_rl_ext.rl.envs.sandbox import _take_uid; "
                               "print(_take_uid()[0], flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        held = int(holder.stdout.readline())  # type: ignore[union-attr]
        uid, fd = _take_uid()
        os.close(fd)
        assert uid != held
    finally:
        holder.kill()
        holder.wait()
    uid2, fd2 = _take_uid()  # the holder's lock died with it
    os.close(fd2)
    assert uid2 == min(held, uid)
