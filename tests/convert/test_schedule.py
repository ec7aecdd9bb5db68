"""The calibration stream's schedule (`uptrain.convert.layers.schedule`): who may read which layer when.

Mostly without a model: `StreamSchedule` is driven over random interleavings of its users'
requests and checked against the contract written out here (a layer is freed exactly when every
user has moved past it, a forgotten layer is a named error, one user alone restarts); the handles'
settings are checked not to leak; one real-model run checks the Calibration keeps the contract.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from uptrain.convert.layers.layer import LayerGone
from uptrain.convert.layers.schedule import (READY, RESTART, RUN, WAIT, StreamMovedOn, StreamSchedule, StreamStopped,
                                             StreamUser, stream_keep)

LAYERS = 6


class Spec:
    """The contract as the module docstring states it, kept apart from the schedule's own bookkeeping."""

    def __init__(self, users: int):
        self.users = users
        self.asked = [-1] * users  # the latest layer each user asked for
        self.left = [False] * users
        self.taken: list[set[int]] = [set() for _ in range(users)]
        self.ran: list[int] = []

    @property
    def held(self) -> int | None:
        return self.ran[-1] if self.ran else None

    def moved_past(self, user: int, index: int) -> bool:
        return self.left[user] or self.asked[user] > index

    def everyone_past_held(self) -> bool:
        return self.held is None or all(self.moved_past(u, self.held) for u in range(self.users))

    def remembered(self) -> set[int]:
        return {i for i in self.ran if i == self.held or any(not self.left[u] and i not in self.taken[u]
                                                              for u in range(self.users))}


def scripts(rng: random.Random, users: int) -> list[list[tuple[str, int]]]:
    """Each user's requests, as a conversion makes them: in layer order, some layers skipped, each
    visited layer's moments and, for some, the layer after them (refinement); then it leaves."""
    out = []
    for _ in range(users):
        requests = []
        for i in range(LAYERS):
            if rng.random() < 0.15:
                continue
            requests.append(("sigma", i))
            if rng.random() < 0.5:
                requests.append(("layer", i))
        out.append(requests + [("leave", -1)])
    return out


def simulate(users: int, slow: int, seed: int) -> None:
    """Users interleaved at random (`slow` picked 8 times less often than each other user), with
    stray requests for earlier layers; every answer of the schedule is checked against `Spec`."""
    rng = random.Random(seed)
    schedule, spec = StreamSchedule(users), Spec(users)
    schedule.opened(LAYERS)
    todo = scripts(rng, users)
    wanted = [[i for kind, i in script if kind == "sigma"] for script in todo]
    got: list[list[int]] = [[] for _ in range(users)]
    waiting: set[int] = set()
    while any(todo):
        active = [u for u in range(users) if todo[u] and u not in waiting]
        assert active, f"deadlock: every user waits (held {spec.held}, asked {spec.asked})"
        user = rng.choices(active, [1 if u == slow else 8 for u in active])[0]
        if rng.random() < 0.1 and spec.asked[user] > 0:  # a stray request for an earlier layer
            stray(schedule, spec, user, rng.randrange(spec.asked[user]))
            continue
        kind, index = todo[user][0]
        if kind == "leave":
            schedule.leave(user)
            spec.left[user] = True
            todo[user].pop(0)
            waiting.clear()  # a user moved on: everyone may try again
        else:
            outcome = ask(schedule, spec, user, index, kind == "sigma", got)
            if outcome == WAIT:
                waiting.add(user)
            else:
                waiting.clear()
                if outcome == READY:
                    todo[user].pop(0)
        assert schedule.remembered() == spec.remembered(), (schedule.remembered(), spec.remembered())
    assert got == wanted  # each user had the moments of every layer it asked for, once


def ask(schedule: StreamSchedule, spec: Spec, user: int, index: int, moments: bool, got: list[list[int]]) -> str:
    """One scripted request (always for a layer the user has not moved past) and its checks."""
    step = schedule.step(user, index, moments, f"model.layers.{index}.self_attn.")
    spec.asked[user] = max(spec.asked[user], index)
    assert step != RESTART, "restart with several users"
    if index in spec.remembered():
        assert step == READY, (step, index)
        if moments:
            layer = schedule.take(user, index)
            assert layer == f"L{index}"
            spec.taken[user].add(index)
            got[user].append(index)
        return step
    assert index not in spec.ran, f"user {user} fell behind: layer {index} forgotten"
    if spec.everyone_past_held():
        assert step == RUN, (step, spec.held, spec.asked)  # run as soon as every user is past the held one
        spec.ran.append(schedule.position)
        schedule.ran(schedule.position, f"L{schedule.position}")
    else:
        assert step == WAIT, (step, spec.held, spec.asked)  # freeing now would take the held layer from someone
    return step


def stray(schedule: StreamSchedule, spec: Spec, user: int, index: int) -> None:
    """A request for a layer the user has moved past: the layer if remembered, else the named error."""
    name = f"model.layers.{index}.self_attn."
    if index in spec.remembered():
        assert schedule.step(user, index, False, name) == READY
    elif index in spec.ran:
        with pytest.raises(StreamMovedOn) as err:
            schedule.step(user, index, False, name)
        assert (err.value.index, err.value.user, err.value.position) == (index, user, len(spec.ran))
        assert (f"layer {index} (model.layers.{index}.self_attn) is gone: the calibration stream had moved on to "
                f"layer {len(spec.ran)} when user {user} asked for it") in str(err.value)


SLOW = [(users, slow) for users in (2, 3, 4) for slow in range(users)]


@pytest.mark.parametrize(("users", "slow"), SLOW, ids=[f"{u}users-slow{s}" for u, s in SLOW])
def test_a_layer_is_freed_exactly_when_every_user_has_moved_past_it(users, slow):
    """Over 60 random interleavings per case, whichever user is slow: the stream runs the next layer
    (freeing the held one) exactly when every user has moved past the held one, never before (the
    slow user never finds its layer gone) and never later (no request waits needlessly); the layers
    remembered are the held one and those whose moments a user still has to take; no deadlock."""
    for seed in range(60):
        simulate(users, slow, seed)


def serve(schedule: StreamSchedule, user: int, index: int) -> str | None:
    """`user`'s moments of layer `index`, running the stream as far as the schedule lets it; None: it waits."""
    while (step := schedule.step(user, index, True)) == RUN:
        schedule.ran(schedule.position, f"L{schedule.position}")
    return schedule.take(user, index) if step == READY else None


def test_a_user_behind_the_stream_gets_the_error_naming_why():
    schedule = StreamSchedule(2)
    schedule.opened(3)
    for i in range(3):
        pending = [0, 1]
        while pending:
            pending = [u for u in pending if serve(schedule, u, i) is None]
    with pytest.raises(StreamMovedOn, match=r"layer 0 \(model.layers.0.self_attn\) is gone: the calibration stream "
                                            r"had moved on to layer 3 when user 1 asked for it"):
        schedule.step(1, 0, False, "model.layers.0.self_attn.")
    with pytest.raises(LayerGone, match="layer 2's moments were handed out already: user 0"):
        schedule.step(0, 2, True)  # still held, but user 0 took them: the other user's share is not its
    schedule.leave(0)
    with pytest.raises(LayerGone, match="user 0 left the calibration stream"):
        schedule.step(0, 2, False)
    with pytest.raises(Exception, match="no attention module layer 5"):
        schedule.step(1, 5, False)


def test_only_a_single_user_restarts():
    """One user asking again for moments it took (or asking after it left) starts a new pass; with
    several users the same requests are errors, never a restart."""
    single = StreamSchedule(1)
    single.opened(2)
    assert single.step(0, 0, True) == RUN
    single.ran(0, "L0")
    assert single.step(0, 0, True) == READY and single.take(0, 0) == "L0"
    assert single.step(0, 0, False) == READY  # the layer itself, still held: no restart
    assert single.step(0, 0, True) == RESTART
    single.leave(0)
    assert single.step(0, 1, False) == RESTART
    for users in (2, 3):
        shared = StreamSchedule(users)
        shared.opened(2)
        assert shared.step(0, 0, True) == RUN
        shared.ran(0, "L0")
        shared.step(0, 0, True)
        shared.take(0, 0)
        with pytest.raises(LayerGone):
            shared.step(0, 0, True)
        shared.leave(0)
        with pytest.raises(LayerGone, match="left"):
            shared.step(0, 1, True)


class Runner:
    """A stream of plain values: layer i is 'L{i}'; records which user's request ran each layer."""

    def __init__(self, delay: float = 0.0):
        self.runs: list[tuple[int, int]] = []
        self.delay = delay

    def locate(self, name: str) -> int:
        return int(name)

    def run_next(self, user: int, index: int) -> str:
        time.sleep(self.delay)
        self.runs.append((index, user))
        return f"L{index}"

    def restart(self) -> None:
        self.runs.append((-1, -1))


def test_threads_blocking_on_the_schedule_each_get_every_layer_once():
    """`request` under real threads (3 users, the middle one slow): every user gets every layer,
    each layer runs once, in order; a user failing stops the others waiting (no hang)."""
    schedule, runner = StreamSchedule(3), Runner()
    schedule.opened(LAYERS)
    got: dict[int, list[str]] = {u: [] for u in range(3)}

    def user(u: int) -> None:
        for i in range(LAYERS):
            got[u].append(schedule.request(u, str(i), runner, take=lambda layer: layer))
            if u == 1:
                time.sleep(0.01)
        schedule.depart(u)
    threads = [threading.Thread(target=user, args=(u,)) for u in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(got[u] == [f"L{i}" for i in range(LAYERS)] for u in range(3)), got
    assert [i for i, _ in runner.runs] == list(range(LAYERS))

    stopped = StreamSchedule(2)
    stopped.opened(LAYERS)
    stopped.request(0, "0", Runner(), take=lambda layer: layer)
    errors = []
    waiter = threading.Thread(target=lambda: errors.append(pytest.raises(StreamStopped, stopped.request, 0, "1",
                                                                         Runner())))
    waiter.start()
    time.sleep(0.05)
    stopped.depart(1, failed="RuntimeError('boom')")
    waiter.join(timeout=10)
    assert not waiter.is_alive() and "stopped: RuntimeError('boom')" in str(errors[0].value)


class Owner:
    keep = "moments"

    def __init__(self):
        self.requests: list[tuple[int, str, bool]] = []

    def request(self, user: int, name: str, moments: bool):
        self.requests.append((user, name, moments))


def test_each_user_changes_only_its_own_handle():
    """keep and threads are the handle's: set on one, no other handle and not the owner changes;
    unset, a handle follows the owner's keep; a handle asked for another user refuses."""
    owner = Owner()
    handles = [StreamUser(owner, u) for u in range(3)]
    rng = random.Random(0)
    for _ in range(200):
        u = rng.randrange(3)
        before = [(h.keep, h.threads) for h in handles]
        if rng.random() < 0.5:
            handles[u].keep = rng.choice(["moments", "attention", "layer", None])
        else:
            handles[u].threads = rng.choice([None, 1, 2, 4])
        assert [(h.keep, h.threads) for i, h in enumerate(handles) if i != u] == \
               [b for i, b in enumerate(before) if i != u]
        assert owner.keep == "moments"
    handles[0].keep = None
    owner.keep = "layer"
    assert handles[0].keep == "layer"
    with pytest.raises(ValueError, match="keep must be one of"):
        handles[1].keep = "everything"
    handles[2].sigma("model.layers.0.self_attn.", user=2)
    with pytest.raises(ValueError, match="handle of user 2 was asked for user 0"):
        handles[2].layer("model.layers.0.self_attn.", user=0)
    assert owner.requests == [(2, "model.layers.0.self_attn.", True)]


def test_the_stream_keeps_what_its_users_need_between_them():
    assert stream_keep(["moments", "moments"]) == "moments"
    assert stream_keep(["moments", "attention", "moments"]) == "attention"
    assert stream_keep(["layer", "moments"]) == "layer"
    assert stream_keep(["all", "attention"]) == stream_keep(["layer", "all"]) == stream_keep(["all"]) == "all"
    with pytest.raises(ValueError, match="need attention and layer kept"):
        stream_keep(["attention", "layer"])


def test_three_users_of_a_real_stream_with_their_own_settings(one_torch_thread, monkeypatch):
    """stories260K, 3 users in threads (the middle one slow): user 0 needs the attention kept, the
    others only moments, so the stream keeps it and the slow user still finds its recordings; each
    layer runs with the threads of the user whose request ran it, torch's count restored after;
    the shared Calibration's keep never changed."""
    import torch

    from conftest import EXAMPLE_MHA8, TRAIN_TXT
    from uptrain.convert.layers.calibrate import Calibration
    from uptrain.convert.layers.layer_stream import LayerStream

    calibration = Calibration(TRAIN_TXT, 600).bind(EXAMPLE_MHA8)
    handles = calibration.share(3)
    handles[0].keep, handles[1].threads, handles[2].threads = "attention", 2, 1
    runs = []
    advance = LayerStream.advance

    def counted(stream):
        runs.append((threading.current_thread().name, torch.get_num_threads()))
        return advance(stream)
    monkeypatch.setattr(LayerStream, "advance", counted)
    prefixes = [f"model.layers.{i}.self_attn." for i in range(5)]
    errors = []

    def user(handle: StreamUser) -> None:
        try:
            for p in prefixes:
                handle.sigma(p)
                if handle.index == 1:
                    time.sleep(0.05)
                    assert len(handle.layer(p).recorded().inputs) > 0
            handle.leave()
        except BaseException as err:  # noqa: BLE001 (asserted below)
            errors.append(err)
            handle.leave(failed=repr(err))
    threads = [threading.Thread(target=user, args=(h,), name=f"user{h.index}") for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert calibration.keep == "moments" and calibration.record["layers_run"] == 5
    wanted = {"user0": 1, "user1": 2, "user2": 1}  # user 0: None, the stream's (torch's 1 at the start)
    assert len(runs) == 5 and all(threads == wanted[name] for name, threads in runs), runs
    assert torch.get_num_threads() == 1
    with pytest.raises(ValueError, match="shared before it starts"):
        calibration.share(2)


def test_a_model_run_whole_hands_every_layer_out_at_once(one_torch_thread, monkeypatch):
    """Where the model cannot be streamed it runs whole, and the schedule hands every layer out at
    once (none held): each of 2 users takes every layer's moments, equal to the streamed ones; a
    layer both took is `StreamMovedOn`; a single user asking again runs the model again."""
    import torch

    from conftest import EXAMPLE_MHA8, TRAIN_TXT
    from uptrain.convert.layers import calibrate
    from uptrain.convert.layers.layer_stream import StreamUnsupported

    Calibration = calibrate.Calibration
    prefixes = [f"model.layers.{i}.self_attn." for i in range(5)]
    streamed = Calibration(TRAIN_TXT, 600).bind(EXAMPLE_MHA8)
    expected = [streamed.sigma(p) for p in prefixes]

    def unsupported(*args, **kwargs):
        raise StreamUnsupported("not here")
    monkeypatch.setattr(calibrate, "LayerStream", unsupported)
    shared = Calibration(TRAIN_TXT, 600).bind(EXAMPLE_MHA8)
    first, second = shared.share(2)
    for p, sigma in zip(reversed(prefixes), reversed(expected)):  # any order: none is held
        torch.testing.assert_close(second.sigma(p), sigma, rtol=1e-6, atol=1e-8)
    for p, sigma in zip(prefixes, expected):
        torch.testing.assert_close(first.sigma(p), sigma, rtol=1e-6, atol=1e-8)
    assert shared.record["mode"] == "whole model" and shared.record["passes"] == 1
    with pytest.raises(StreamMovedOn, match="layer 2 .* user 0"):
        first.layer(prefixes[2])
    single = Calibration(TRAIN_TXT, 600).bind(EXAMPLE_MHA8)
    again = [single.sigma(prefixes[0]), single.sigma(prefixes[0])]
    torch.testing.assert_close(again[0], again[1], rtol=0, atol=0)
    assert single.record["passes"] == 2
