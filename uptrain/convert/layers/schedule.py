"""The schedule of one calibration stream and its users: who may read which layer when.

A calibration stream (`calibrate.Calibration` over a `layer_stream.LayerStream`) runs the original
model's decoder layers in order, each once per pass. One conversion reads it, or several at once
(a sweep's K/V counts, each in its own thread: `several.convert_counts`). Each reads through its
own handle, a `StreamUser` (`Calibration.user(i)`; `Calibration.share(n)` makes n of them before
the stream starts). This module is the whole contract between the users and the stream;
`StreamSchedule` keeps it without knowing what a layer is (tests drive it with plain values).

Positions. A user's position is the latest layer it has asked for (its moments, `sigma`, or the
layer itself, `layer`); once it leaves (`leave`) it is past every layer. Asking for layer i says
the user is done with every layer before i, so a position never goes back.

Running and freeing. The stream runs a layer only when some user asks for it (or for a later one),
and in order. The layer run last is *held* (its module and recordings, as much as `keep` names)
until the stream runs the next one, and the stream runs the next one only once EVERY user has moved
past the held one (its position is later, or it has left); a user asking for a later layer before
that waits. So a layer is freed exactly when every user has moved past it and one of them asks for
a later layer. Its moments outlive it: each user takes each layer's moments once, and the layer is
forgotten once it is freed and no user still has to take them (a user that leaves owes none).

Who may read which layer when. A user may ask for the held layer or for any layer whose moments it
has still to take (it gets the layer object, which answers only what it still holds, else raises
`layer.LayerGone`), or for a later layer (it waits until the stream can run that far). Anything
else is an error that says why:

- a layer the stream has forgotten: `StreamMovedOn` (a `LayerGone`) naming the layer, the layer the
  stream had moved on to and the user;
- (several users) moments the user has taken already, or any request after it left: `LayerGone`;
- a layer beyond the model's last: a one-line `UsageError`;
- once a user of several has left with an error, every other request: `StreamStopped`, rather than
  waiting for a user that will never move on.

The restart rule (here and only here: `StreamSchedule.step`). With ONE user, a request for moments
it has already taken (a second conversion from one Calibration, as the method bake-off does) or
any request after it left starts a new pass: the stream runs again from the first layer. With
several users there is never a restart: each would have to be told to start over.

What a user may change: only its own handle. `keep`, what it needs each layer to keep (the stream
keeps what its users need between them, fixed when a pass starts: `stream_keep`), and `threads`,
torch's intra-op threads for the layer runs its own requests start (set for the run, restored
after it). A run's result is every user's and torch's count is the process's, so
`several.convert_counts` gives every user the same count: no result depends on whose request ran
a layer. Nothing on the shared Calibration: its `keep` is only the default of handles that set
none, and the number of users is fixed before the stream starts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from uptrain.convert.layers.layer import KEEP, LayerGone
from uptrain.errors import UsageError

READY, RUN, WAIT, RESTART = "ready", "run", "wait", "restart"  # what `StreamSchedule.step` answers
PAST = float("inf")  # the position of a user that has left: past every layer


class StreamMovedOn(LayerGone):
    """A user asked for a layer the stream has run and forgotten: every user had moved past it."""

    def __init__(self, index: int, name: str, position: int, user: int):
        self.index, self.name, self.position, self.user = index, name, position, user
        super().__init__(f"layer {index} ({name.rstrip('.')}) is gone: the calibration stream had moved on to layer "
                         f"{position} when user {user} asked for it (a shared stream frees a layer once every user "
                         f"has asked for a later one or left)")


class StreamStopped(RuntimeError):
    """Another user of the stream ended with an error: waiting for it to move on would be forever."""


def stream_keep(keeps: list[str]) -> str:
    """What the stream keeps of each layer for users who need `keeps`: every keep has the moments,
    so 'moments' gives way to the other; 'all' holds what 'attention' and 'layer' hold; 'attention' and
    'layer' together cannot be kept (ValueError)."""
    for keep in keeps:
        if keep not in KEEP:
            raise ValueError(f"keep must be one of {KEEP}, not {keep!r}")
    needs = sorted(set(keeps) - {"moments"})
    if "all" in needs:
        return "all"
    if len(needs) > 1:
        raise ValueError(f"the users of one calibration stream need {' and '.join(needs)} kept; a stream keeps one "
                         f"of them (every user of a sweep refines on the same inputs)")
    return needs[0] if needs else "moments"


class Runner(Protocol):
    """What runs the layers a `StreamSchedule` asks for (`calibrate.Calibration`)."""

    def locate(self, name: str) -> int:
        """The index of layer `name`, opening the pass first if none is open (and telling the schedule)."""

    def run_next(self, user: int, index: int) -> Any:
        """Run layer `index` (the next), for a request of `user`; what the users will be handed."""

    def restart(self) -> None:
        """Drop the pass so far (the next `locate` opens a new one)."""


class StreamSchedule:
    """The positions of the users of one stream and the layers it remembers (see the module docstring).

    `step` decides one request without blocking; `request` blocks on `turn` until it is served.
    Layers are whatever the runner hands over (`layer.Layer` for a Calibration).
    """

    def __init__(self, users: int = 1, turn: threading.Condition | None = None):
        if users < 1:
            raise ValueError(f"a stream has at least one user, not {users}")
        self.users = users
        self.turn = turn or threading.Condition()
        self.failed = ""  # a user of several left with this error
        self.touched = False  # a user asked or left: the users are fixed from then on
        self.new_pass()

    def new_pass(self) -> None:
        """No layer run yet (a restart forgets the pass so far: only with one user, see `step`)."""
        self.length: int | None = None  # how many layers the stream has, once a pass is open
        self.position = 0  # the next layer to run
        self.held: int | None = None  # the layer run last, not yet freed
        self._at: list[float] = [-1] * self.users  # each user's position
        self._left: set[int] = set()
        self._taken: list[set[int]] = [set() for _ in range(self.users)]  # layers whose moments each took
        self._run: set[int] = set()  # layers run in this pass
        self._owed: dict[int, set[int]] = {}  # remembered layer -> the users still to take its moments
        self._layers: dict[int, Any] = {}  # remembered layer -> what the runner handed over

    # ------------------------------------------------------------------ the rules

    def moved_past(self, user: int, index: int) -> bool:
        """Whether `user` is done with layer `index` (it asked for a later one, or left)."""
        return self._at[user] > index

    def may_run_next(self) -> bool:
        """The stream may run the next layer (freeing the held one): every user has moved past the held one."""
        return self.held is None or all(self.moved_past(u, self.held) for u in range(self.users))

    def remembered(self) -> set[int]:
        """The layers a user may still be handed: the held one and those whose moments a user has still to take."""
        return set(self._layers)

    def step(self, user: int, index: int, moments: bool = False, name: str = "") -> str:
        """Decide `user`'s request for layer `index` (`name`, for messages): READY (it is remembered),
        RUN (run the next layer, then ask again), WAIT (until another user moves on), RESTART (a new
        pass, then ask again: the one restart rule); or raise, as the module docstring lists."""
        if not 0 <= user < self.users:
            raise ValueError(f"user {user} is not one of the stream's {self.users} users")
        name = name or f"layer {index}"
        self.touched = True
        if self.failed:
            raise StreamStopped(f"the calibration stream stopped: {self.failed}")
        if self.users == 1 and (user in self._left or (moments and index in self._taken[user])):
            return RESTART
        if user in self._left:
            raise LayerGone(f"user {user} left the calibration stream and then asked for layer {index} "
                            f"({name.rstrip('.')})")
        self._at[user] = max(self._at[user], index)
        if index in self._layers:
            if moments and index in self._taken[user]:
                raise LayerGone(f"layer {index}'s moments were handed out already: user {user} took them before "
                                f"(each user takes each layer's moments once)")
            return READY
        if index in self._run:
            raise StreamMovedOn(index, name, self.position, user)
        if self.length is not None and (index >= self.length or self.position >= self.length):
            raise UsageError(f"calibration found no attention module {name.rstrip('.')} in the loaded model")
        return RUN if self.may_run_next() else WAIT

    # ------------------------------------------------------------------ what happened

    def opened(self, layers: int) -> None:
        """A pass is open over a stream of `layers` layers (none run yet)."""
        self.length = layers

    def ran(self, index: int, layer: Any) -> None:
        """The stream ran layer `index` (freeing the one held before); `layer` is what users are handed."""
        if index != self.position or not self.may_run_next():
            raise RuntimeError(f"the stream ran layer {index} out of turn (next {self.position}, held {self.held}, "
                               f"positions {self._at})")
        freed, self.held = self.held, index
        self.position = index + 1
        self._run.add(index)
        self._layers[index] = layer
        self._owed[index] = {u for u in range(self.users) if u not in self._left}
        if freed is not None:
            self._forget_if_done(freed)

    def hand_out(self, layers: dict[int, Any]) -> None:
        """Every layer at once, none held (the whole model was run: no stream to hold a layer)."""
        for index, layer in layers.items():
            self._layers[index] = layer
            self._owed[index] = {u for u in range(self.users) if u not in self._left}
            self._run.add(index)
        self.position = self.length = max(layers, default=-1) + 1

    def take(self, user: int, index: int) -> Any:
        """`user` takes the moments of remembered layer `index` (after `step` said READY): the layer."""
        layer = self._layers[index]
        self._taken[user].add(index)
        self._owed[index].discard(user)
        self._forget_if_done(index)
        return layer

    def leave(self, user: int, failed: str = "") -> None:
        """`user` is done with every layer; `failed`: it ended with this error (several users: the others stop)."""
        self.touched = True
        self._at[user] = PAST
        self._left.add(user)
        if failed and self.users > 1:
            self.failed = failed
        for index, owed in list(self._owed.items()):
            owed.discard(user)
            self._forget_if_done(index)

    def _forget_if_done(self, index: int) -> None:
        if index != self.held and not self._owed.get(index):
            self._layers.pop(index, None)
            self._owed.pop(index, None)

    # ------------------------------------------------------------------ serving a request

    def request(self, user: int, name: str, runner: Runner, take: Callable[[Any], Any] | None = None) -> Any:
        """Serve `user`'s request for layer `name`: the layer, or with `take` (a moments request) what
        `take` makes of it (under the lock, once per user). Blocks while the schedule says WAIT."""
        with self.turn:
            while True:
                index = runner.locate(name)
                step = self.step(user, index, take is not None, name)
                self.turn.notify_all()  # this user's position moved: a waiting one may run on now
                if step == READY:
                    return take(self.take(user, index)) if take is not None else self._layers[index]
                if step == RESTART:
                    runner.restart()
                    self.new_pass()
                elif step == RUN:
                    self.ran(self.position, runner.run_next(user, self.position))
                    self.turn.notify_all()
                else:
                    self.turn.wait()

    def depart(self, user: int, failed: str = "") -> None:
        """`leave`, under the lock, waking the users waiting on this one."""
        with self.turn:
            self.leave(user, failed)
            self.turn.notify_all()


class StreamUser:
    """One user's handle on a shared calibration stream: its own settings and its requests.

    keep: what this user needs each layer to keep (`layer.KEEP`); unset, the owner's `keep`.
    threads: torch's intra-op threads for the layer runs this user's requests start; None: the
    stream's (torch's count when the pass started). Every other attribute (record, windows, device,
    describe, first_inputs, ...) is the owner's, read through the handle: a handle passes for the
    Calibration wherever a conversion takes one (`pipeline.prepare`, `LayerRefiner`).
    """

    def __init__(self, owner: Any, index: int):
        self._owner, self.index = owner, index
        self._keep: str | None = None
        self.threads: int | None = None

    @property
    def keep(self) -> str:
        return self._keep if self._keep is not None else self._owner.keep

    @keep.setter
    def keep(self, keep: str | None) -> None:
        if keep is not None and keep not in KEEP:
            raise ValueError(f"keep must be one of {KEEP}, not {keep!r}")
        self._keep = keep

    def _mine(self, user: int | None) -> None:
        if user is not None and user != self.index:  # `partial(sigma, user=...)` from a caller that counts users
            raise ValueError(f"the handle of user {self.index} was asked for user {user}")

    def sigma(self, name: str, user: int | None = None) -> Any:
        """The moments of layer `name` (see `Calibration.sigma`), taken once by this user."""
        self._mine(user)
        return self._owner.request(self.index, name, moments=True)

    def layer(self, name: str, user: int | None = None) -> Any:
        """Layer `name` (see `Calibration.layer`); asking says this user is done with the layers before it."""
        self._mine(user)
        return self._owner.request(self.index, name, moments=False)

    def leave(self, failed: str = "") -> None:
        """This user is done with every layer; `failed`: it ended with this error."""
        self._owner.leave(self.index, failed)

    def bind(self, model_dir: Path) -> "StreamUser":
        self._owner.bind(model_dir)
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._owner, name)

    def __repr__(self) -> str:
        return f"StreamUser({self.index}, keep={self.keep!r}, threads={self.threads})"
