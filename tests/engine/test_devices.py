"""Sessions on several devices (`devices=2`: two CPU ranks here), against the one-device engine.

The two-rank session and its one-device twin are made once for the module (starting a rank takes
seconds) and every test does the same operations on both, so their models stay in step: each test
compares what the two return and hold. A process holds one multi-device session at a time, so the
session with a sharded base starts once the pair's two-rank one is closed, and is compared with fresh
models on the one-device twin.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

import workbench as wb
from tests.datums import ragged_ce_batch, random_tokens, rl_datum
from tests.interrupts import WAIT_S, Blocker, ctrl_c_once_waiting
from workbench.engine.local.engine import choose_sharding
from workbench.engine.local.ranks import RankFailedError
from workbench.engine.model.base_model import resolve_model_path
from workbench.notebook.panel.status import StatusBar, devices_memory
from workbench.storage.run_description import read_settings

RELATIVE = 1e-5
ROOT = Path(__file__).resolve().parents[2]
VOCAB = 200


@pytest.fixture(scope="module")
def sharded() -> Iterator[wb.Session]:
    """Two ranks with the base sharded across them (FSDP2), rank-4 LoRA, seed 0."""
    sess = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False, devices=2, shard_base=True)
    yield sess
    sess.close()


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RELATIVE * max(abs(a), abs(b), 1e-6)


def _assert_tensors_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-6)
    assert float((a - b).abs().max()) <= RELATIVE * scale, what


def _assert_same_call(two: wb.ForwardBackwardOutput, one: wb.ForwardBackwardOutput) -> None:
    """Equal metrics, and per-datum outputs in datum order, to `RELATIVE`."""
    assert two.metrics.keys() == one.metrics.keys()
    for name in one.metrics:
        assert _close(two.metrics[name], one.metrics[name]), (name, two.metrics[name], one.metrics[name])
    assert len(two.loss_fn_outputs) == len(one.loss_fn_outputs)
    for index, (mine, theirs) in enumerate(zip(two.loss_fn_outputs, one.loss_fn_outputs, strict=True)):
        assert mine.keys() == theirs.keys()
        for name in theirs:
            _assert_tensors_close(mine[name].to_torch(), theirs[name].to_torch(), f"datum {index} {name}")


def _assert_gradients_close(mine: dict, theirs: dict) -> None:
    """Each parameter's gradient within `RELATIVE` of the other's, in norm (sums in another order);
    parameters in order (two models' adapters have their own names)."""
    assert len(mine) == len(theirs)
    for (name, gradient), other in zip(theirs.items(), mine.values(), strict=True):
        assert gradient is not None and other is not None, name
        assert float((other - gradient).norm()) <= RELATIVE * max(float(gradient.norm()), 1e-6), name


def _assert_same_gradients(two: wb.Session, one: wb.Session, role: wb.Role = wb.Role.POLICY) -> None:
    _assert_gradients_close(
        two.engine.inspect(two.model_id, role).gradients, one.engine.inspect(one.model_id, role).gradients
    )


def _step_both(two: wb.Session, one: wb.Session, role: wb.Role = wb.Role.POLICY) -> None:
    """An optimizer step on both: the same gradient norm, and every rank with the same model. Then the
    two ranks take the one device's stepped state, bit for bit, so the next comparison starts from
    equal weights: each test's bound is one call's sums in another order, not that plus the drift of
    every step before it (Adam's first steps move each weight by about the learning rate whatever the
    gradient's size, so a 1e-7 difference in a tiny gradient can become a visible one in the weight)."""
    adam = wb.AdamParams(learning_rate=1e-2)
    client_two, client_one = (two.policy, one.policy) if role is wb.Role.POLICY else (two.critic, one.critic)
    assert client_two is not None and client_one is not None
    mine, theirs = client_two.optim_step(adam).result(), client_one.optim_step(adam).result()
    assert _close(mine.metrics["grad_norm"], theirs.metrics["grad_norm"])
    digests = two.engine.rank_digests(two.model_id)
    assert len(digests) == 2 and digests[0] == digests[1]
    if role is wb.Role.POLICY:
        stepped = one.policy.save_state(f"stepped-{time.monotonic_ns()}").result().path
        two.policy.load_state_with_optimizer(stepped).result()
        one.policy.load_state_with_optimizer(stepped).result()  # a load bumps the weights version: both load
        assert two.engine.rank_digests(two.model_id) == [one.engine.state_digest(one.model_id)] * 2


def _rl_batch(seed: int) -> list[wb.Datum]:
    """Two groups of four completions sharing a prompt (each group stays on one rank), and two loose
    datums, of ragged lengths."""
    rng = random.Random(seed)
    data = []
    for group in range(2):
        prompt = random_tokens(rng, 6 + 3 * group, VOCAB)
        for _ in range(4):
            tokens = prompt + random_tokens(rng, rng.randint(2, 6), VOCAB)
            logprobs = [-rng.uniform(0.5, 3.0) for _ in range(len(tokens) - 1)]
            data.append(rl_datum(tokens, len(prompt), logprobs, rng.uniform(-1, 1)))
    for _ in range(2):
        tokens = random_tokens(rng, rng.randint(5, 12), VOCAB)
        logprobs = [-rng.uniform(0.5, 3.0) for _ in range(len(tokens) - 1)]
        data.append(rl_datum(tokens, 2, logprobs, rng.uniform(-1, 1)))
    return data


def test_the_session_names_its_devices(pair: tuple[wb.Session, wb.Session]) -> None:
    two, one = pair
    assert two.engine.devices == ["cpu", "cpu"] and one.engine.devices == ["cpu"]
    assert "2 ranks on cpu, cpu" in repr(two)
    assert len(two.engine.rank_pids) == 1 and one.engine.rank_pids == []
    bar = StatusBar(two)  # each rank's device and its memory in use, rank 0 first
    bar.refresh()
    memory = re.search(r'"memory"><b>memory</b> ([^<]*)<', bar.widget.value)
    assert memory is not None and re.fullmatch(r"cpu [\d.]+ [KMG]iB · cpu [\d.]+ [KMG]iB", memory.group(1))
    assert all(used > 2**20 for used in two.engine.rank_memory_bytes())
    assert devices_memory(["cuda:0", "cuda:1"], [3 * 2**30, 640 * 2**20]) == "cuda:0 3 GiB · cuda:1 640 MiB"


@pytest.mark.parametrize(
    ("loss_fn", "data"),
    [
        ("cross_entropy", ragged_ce_batch(0, 7, 3, 18, VOCAB)),
        ("importance_sampling", _rl_batch(1)),
        ("ppo", _rl_batch(2)),
    ],
)
def test_every_loss_equals_one_device(
    pair: tuple[wb.Session, wb.Session], loss_fn: str, data: list[wb.Datum]
) -> None:
    two, one = pair
    _assert_same_call(two.policy.forward(data, loss_fn).result(), one.policy.forward(data, loss_fn).result())
    mine = two.policy.forward_backward(data, loss_fn).result()
    theirs = one.policy.forward_backward(data, loss_fn).result()
    _assert_same_call(mine, theirs)
    _assert_same_gradients(two, one)
    _step_both(two, one)


def test_a_custom_loss_equals_one_device(pair: tuple[wb.Session, wb.Session]) -> None:
    """A loss that is not a sum over datums (the square of the mean logprob) runs whole on rank 0."""
    two, one = pair
    data = ragged_ce_batch(3, 5, 4, 14, VOCAB)

    def squared_mean(_data: list[wb.Datum], logprobs_list: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        mean = torch.cat(logprobs_list).mean()
        return mean**2, {"mean_logprob:mean": float(mean.detach())}

    mine = two.policy.forward_backward_custom(data, squared_mean).result()
    theirs = one.policy.forward_backward_custom(data, squared_mean).result()
    _assert_same_call(mine, theirs)
    # the loss the Runs tab lists, recorded on several devices as on one
    assert read_settings(two.model_dir)["policy"]["loss"] == read_settings(one.model_dir)["policy"]["loss"]
    assert read_settings(two.model_dir)["policy"]["loss"]["loss_fn"].startswith("custom: ")
    _assert_same_gradients(two, one)
    _step_both(two, one)


def test_the_critic_equals_one_device(pair: tuple[wb.Session, wb.Session]) -> None:
    """The critic (mirrored to the follower when made) trains with ppo_critic on both ranks; two rounds,
    since its value head starts at zero (the first gradient reaches only the head)."""
    two, one = pair
    rng = random.Random(9)
    data = []
    for _ in range(5):
        tokens = random_tokens(rng, rng.randint(4, 14), VOCAB)
        n = len(tokens) - 1
        inputs = {
            "target_tokens": tokens[1:],
            "values": [rng.uniform(-1, 1) for _ in range(n)],
            "returns": [rng.uniform(-1, 1) for _ in range(n)],
        }
        data.append(wb.Datum(model_input=wb.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    critic_two, critic_one = two.create_critic(), one.create_critic()
    for _ in range(2):
        mine = critic_two.forward_backward(data, "ppo_critic").result()
        theirs = critic_one.forward_backward(data, "ppo_critic").result()
        _assert_same_call(mine, theirs)
        _assert_same_gradients(two, one, wb.Role.CRITIC)
        _step_both(two, one, wb.Role.CRITIC)


def test_ctrl_c_during_a_two_rank_call_leaves_the_ranks_consistent(
    pair: tuple[wb.Session, wb.Session],
) -> None:
    """Ctrl-C while the kernel waits on a two-rank call that runs interrupts the wait only: the call
    ends on both ranks. Ctrl-C while a mirrored op (deleting the critic) waits behind it withdraws the op
    on both ranks. Afterwards the ranks hold the same model, and the next step equals one device's."""
    two, one = pair
    data = ragged_ce_batch(6, 5, 3, 14, VOCAB)
    critic_before = two.engine.rank_digests(two.model_id, wb.Role.CRITIC)
    blocker = Blocker()
    held = blocker.hold(two, data)  # a custom loss: it runs on rank 0, then every rank's backward
    with pytest.raises(KeyboardInterrupt), ctrl_c_once_waiting(after=blocker.release):
        held.result()
    held.result(timeout=WAIT_S)
    second = Blocker()
    queued = second.hold(two, data)
    with pytest.raises(KeyboardInterrupt), ctrl_c_once_waiting():
        two.delete_critic()  # queued behind the call the second blocker holds
    second.release()
    queued.result(timeout=WAIT_S)
    assert two.critic is not None and two.config.critic is not None
    assert two.engine.rank_digests(two.model_id, wb.Role.CRITIC) == critic_before  # on both ranks
    policy = two.engine.rank_digests(two.model_id, wb.Role.POLICY)
    assert len(policy) == 2 and policy[0] == policy[1]
    done = Blocker()
    done.release()
    for _ in range(2):  # the same two calls on the one device
        one.policy.forward_backward_custom(data, done).result()
    _assert_same_gradients(two, one)
    _step_both(two, one)


def test_a_call_split_in_two_accumulates_the_same_gradient(pair: tuple[wb.Session, wb.Session]) -> None:
    """On two ranks, one call equals the same datums in two calls (a second model on the same base,
    made like the first, so mirrored to the follower too)."""
    two, _ = pair
    data = ragged_ce_batch(4, 6, 3, 16, VOCAB)
    engine = two.engine
    whole, halves = (engine.create_model(wb.LoraConfig(rank=4), seed=7).result() for _ in range(2))
    try:
        engine.forward_backward(whole, wb.Role.POLICY, data, "cross_entropy").result()
        engine.forward_backward(halves, wb.Role.POLICY, data[:3], "cross_entropy").result()
        engine.forward_backward(halves, wb.Role.POLICY, data[3:], "cross_entropy").result()
        _assert_gradients_close(
            engine.inspect(halves, wb.Role.POLICY).gradients, engine.inspect(whole, wb.Role.POLICY).gradients
        )
        assert engine.inspect(halves, wb.Role.POLICY).pending_backward_calls == 2
    finally:
        engine.delete_model(whole).result()
        engine.delete_model(halves).result()


def test_a_state_moves_bit_exact_between_two_ranks_and_one(pair: tuple[wb.Session, wb.Session]) -> None:
    """A state saved on two ranks loads into one device as into both ranks, bit for bit, and back (a
    load bumps the weights version, so both sessions load it)."""
    two, one = pair
    data = ragged_ce_batch(5, 4, 3, 12, VOCAB)
    two.policy.forward_backward(data, "cross_entropy").result()
    one.policy.forward_backward(data, "cross_entropy").result()
    _step_both(two, one)
    two.policy.forward_backward(data, "cross_entropy").result()  # a pending gradient is saved too
    saved = two.policy.save_state("from-two-ranks").result().path
    for sess in (one, two):
        sess.policy.load_state_with_optimizer(saved).result()
    assert two.engine.rank_digests(two.model_id) == [one.engine.state_digest(one.model_id)] * 2
    one.policy.forward_backward(data, "cross_entropy").result()  # one device moves ahead, and back
    one.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
    back = one.policy.save_state("from-one-device").result().path
    for sess in (one, two):
        sess.policy.load_state_with_optimizer(back).result()
    assert two.engine.rank_digests(two.model_id) == [one.engine.state_digest(one.model_id)] * 2


def test_a_killed_rank_fails_every_pending_call_naming_it(pair: tuple[wb.Session, wb.Session]) -> None:
    """The pair's two-rank session is broken after it: the next test closes it."""
    two, _ = pair
    engine, model_id = two.engine, two.model_id
    two.policy.save_state("before-the-kill").result()  # what the next test restarts from
    data = ragged_ce_batch(6, 64, 32, 64, VOCAB)
    futures = [engine.forward_backward(model_id, wb.Role.POLICY, data, "cross_entropy") for _ in range(40)]
    futures[0].result()  # the calls are running
    os.kill(engine.rank_pids[0], signal.SIGKILL)
    started = time.monotonic()
    failures = []
    for future in futures[1:]:
        try:
            future.result(timeout=10)
        except RankFailedError as error:
            failures.append(str(error))
    assert time.monotonic() - started < 10
    assert len(failures) >= 30  # the few that finished before the kill took effect did so whole
    assert all("rank 1" in message and "forward_backward" in message for message in failures)
    with pytest.raises(RankFailedError, match="must be restarted"):
        two.policy.forward_backward(data, "cross_entropy")


def test_a_session_whose_rank_died_restarts_from_its_last_saved_state(
    pair: tuple[wb.Session, wb.Session], tmp_path: Path
) -> None:
    """After the killed-rank test: `restart()` closes the broken session and makes one on two ranks again,
    in the same folder, holding the state saved before the kill on both ranks; it trains as one device
    resumed from that state does."""
    two, _ = pair
    old_pids = two.engine.rank_pids
    saved = two.list_checkpoints()[-1]
    assert saved.name == "before-the-kill"
    restarted = two.restart()
    one = wb.Session.from_checkpoint(saved.path, model_dir=tmp_path / "one-device", wandb=False)
    try:
        assert two.closed and not any(psutil.pid_exists(pid) for pid in old_pids)
        assert restarted.engine.devices == ["cpu", "cpu"] and restarted.engine.rank_pids != old_pids
        assert restarted.model_dir == saved.path.parents[1] and restarted.critic is not None
        digests = restarted.engine.rank_digests(restarted.model_id, wb.Role.POLICY)
        assert digests == [one.engine.state_digest(one.model_id, wb.Role.POLICY)] * 2
        data = ragged_ce_batch(7, 5, 3, 14, VOCAB)
        mine = restarted.policy.forward_backward(data, "cross_entropy").result()
        _assert_same_call(mine, one.policy.forward_backward(data, "cross_entropy").result())
        _assert_same_gradients(restarted, one)
    finally:
        pids = restarted.engine.rank_pids
        restarted.close()
        one.close()
    assert not any(psutil.pid_exists(pid) for pid in pids)


def test_restart_without_a_saved_state_says_so_and_changes_nothing(tmp_path: Path) -> None:
    sess = wb.Session("tiny", wb.LoraConfig(rank=4), wandb=False, model_dir=tmp_path / "model")
    try:
        with pytest.raises(wb.CheckpointError, match="holds no saved state to restart from"):
            sess.restart()
        assert not sess.closed
        sess.policy.forward(ragged_ce_batch(8, 2, 3, 8, VOCAB), "cross_entropy").result()
    finally:
        sess.close()


def _is_follower(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return "workbench.engine.local.rank_follower" in process.cmdline()
    return False


def test_close_leaves_no_process(pair: tuple[wb.Session, wb.Session]) -> None:
    """After the killed-rank test: it closes the pair's two-rank session (its rank dead), so that the
    sharded session (one multi-device session per process) can start."""
    two, _ = pair
    pids = two.engine.rank_pids
    two.close()
    assert not any(psutil.pid_exists(pid) for pid in pids)
    # no follower of any session: other tests' helpers (a forkserver) may outlive their own test
    assert not [child for child in psutil.Process().children(recursive=True) if _is_follower(child)]


def test_a_sharded_base_trains_as_one_device_with_half_the_base_per_rank(
    pair: tuple[wb.Session, wb.Session], sharded: wb.Session
) -> None:
    """On a base sharded over two ranks, every built-in loss call, a custom loss and an optimizer step
    equal the one-device engine's (a fresh model on each, made alike), and each rank holds half of the
    base's weights; removing the last model is refused (sampling there:
    tests/engine/test_devices_sampling.py)."""
    _, one = pair
    assert sharded.engine.sharded and "base sharded" in repr(sharded)
    whole = one.engine.rank_base_bytes()[0]
    assert all(0.45 * whole <= held <= 0.55 * whole for held in sharded.engine.rank_base_bytes())
    lora = wb.LoraConfig(rank=4)
    mine, theirs = (
        sharded.engine.create_model(lora, seed=7).result(),
        one.engine.create_model(lora, seed=7).result(),
    )

    def squared_mean(_data: list[wb.Datum], logprobs_list: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        return torch.cat(logprobs_list).mean() ** 2, {}

    try:
        for loss_fn, data in (("cross_entropy", ragged_ce_batch(7, 6, 3, 16, VOCAB)), ("ppo", _rl_batch(8))):
            for engine_call in ("forward", "forward_backward"):
                _assert_same_call(
                    getattr(sharded.engine, engine_call)(mine, wb.Role.POLICY, data, loss_fn).result(),
                    getattr(one.engine, engine_call)(theirs, wb.Role.POLICY, data, loss_fn).result(),
                )
        data = ragged_ce_batch(9, 5, 4, 14, VOCAB)
        _assert_same_call(
            sharded.engine.forward_backward_custom(mine, wb.Role.POLICY, data, squared_mean).result(),
            one.engine.forward_backward_custom(theirs, wb.Role.POLICY, data, squared_mean).result(),
        )
        _assert_gradients_close(
            sharded.engine.inspect(mine, wb.Role.POLICY).gradients,
            one.engine.inspect(theirs, wb.Role.POLICY).gradients,
        )
        adam = wb.AdamParams(learning_rate=1e-2)
        stepped = sharded.engine.optim_step(mine, wb.Role.POLICY, adam).result()
        assert _close(
            stepped.metrics["grad_norm"],
            one.engine.optim_step(theirs, wb.Role.POLICY, adam).result().metrics["grad_norm"],
        )
        digests = sharded.engine.rank_digests(mine)
        assert digests[0] == digests[1]
        _assert_same_call(
            sharded.engine.forward(mine, wb.Role.POLICY, data, "cross_entropy").result(),
            one.engine.forward(theirs, wb.Role.POLICY, data, "cross_entropy").result(),
        )
    finally:
        sharded.engine.delete_model(mine).result()
        one.engine.delete_model(theirs).result()
    with pytest.raises(ValueError, match="last model"):  # its adapters' removal would unwrap the base
        sharded.engine.delete_model(sharded.model_id)


def test_a_base_that_fits_no_device_is_sharded_saying_so(tmp_path: Path) -> None:
    """The automatic choice (shard_base left out), decided before anything loads: tiny fits, and a
    config whose embeddings alone outgrow the host's available memory does not (counted on the meta
    device, nothing allocated)."""
    cpu, ranks = torch.device("cpu"), ["cpu", "cpu"]
    assert not choose_sharding(None, "tiny", ranks, cpu, torch.float32, None)
    config = json.loads((Path(resolve_model_path("tiny")) / "config.json").read_text())
    config["vocab_size"] = psutil.virtual_memory().available // (config["hidden_size"] * 4) + 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="do not fit one cpu device.*sharding them across 2 ranks"):
        assert choose_sharding(None, str(tmp_path), ranks, cpu, torch.float32, None)
    assert not choose_sharding(False, str(tmp_path), ranks, cpu, torch.float32, None)
    with pytest.raises(ValueError, match="give devices="):
        choose_sharding(True, "tiny", [], cpu, torch.float32, None)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_killed_kernel_leaves_no_rank() -> None:
    """A process holding a two-rank engine, SIGKILLed: its follower rank ends within seconds."""
    code = "import time, workbench as wb; e = wb.Engine('tiny', devices=2); print(e.rank_pids[0], flush=True); time.sleep(300)"
    kernel = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert kernel.stdout is not None
        follower = int(kernel.stdout.readline())
    finally:
        kernel.kill()
        kernel.wait()
    deadline = time.monotonic() + 10
    while not _gone(follower) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(follower)
