"""The nodes of a run: waiting for them, asking for their capabilities, sampling them.

The one module of the strategy that talks to the grid about nodes. Capabilities (a node's keep
ratio and stable key) are asked once per node with a ``query`` message and cached; the cache
is pruned to the connected nodes every round, so a node that restarts (new node id) is asked
again. Sampling is seeded and ordered by the stable keys, so a run is reproducible although
Flower draws new node ids at every launch.

A node's key is the ``node-key`` it declares; a node that declares none is known by what
authenticates it: the public key Flower reports for it (``NodeInfo.public_key`` from
``Grid.get_nodes``, as hex; with SuperNode authentication the registered key, the same at every
launch), else its node id. So devices that declare nothing never share a key, and with it a
training seed.

The operator's rules on declared keep ratios (:class:`~fedshard.settings.NodePolicy`) are
applied to every answer (:func:`admit`): a ratio above ``max_keep_ratio`` is clipped to it (with
a warning), and a node bound by the keep-ratio table that declares another ratio is refused
(logged; asked again next round). The table is matched against the public key Flower
authenticated the node with (``NodeInfo.public_key`` from ``Grid.get_nodes``); a declared
``node-key`` selects a name entry only with ``trust_declared_keys``. Two nodes declaring one
key, and an unbound claim of the largest ratio allowed, are warned.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from logging import ERROR, INFO, WARNING
from pathlib import Path

from flwr.common.logger import log
from flwr.serverapp import Grid

from fedshard import protocol as P
from fedshard.sampling import Stream, stream_rng
from fedshard.server.metrics import one_line
from fedshard.settings import NodePolicy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10; tomli comes with flwr
    import tomli as tomllib

__all__ = ["NodeDirectory", "admit", "is_public_key", "load_keep_ratio_table"]


def load_keep_ratio_table(path: str | Path) -> dict[str, float]:
    """Read a keep-ratio table: a TOML file of ``"<node key or public key>" = <ratio>`` lines
    (top level, or under ``[keep-ratios]``). Raises ``ValueError`` naming the problem."""
    try:
        data = tomllib.loads(Path(path).expanduser().read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ValueError(f"keep-ratio-table={str(path)!r} cannot be read as TOML ({err}); "
                         "expected lines such as '\"node-3\" = 0.2'; no round was started") from err
    table = data.get("keep-ratios", data)
    bad = [f"{k}={v!r}" for k, v in table.items()
           if isinstance(v, bool) or not isinstance(v, (int, float))]
    if not isinstance(table, dict) or bad:
        raise ValueError(f"keep-ratio-table={str(path)!r}: expected '\"<node key>\" = <ratio>' "
                         f"entries, found {bad[:5]}; no round was started")
    return {str(k): float(v) for k, v in table.items()}


def _short(key: str, limit: int = 24) -> str:
    return key if len(key) <= limit else key[:limit] + "…"


def is_public_key(entry: str) -> bool:
    """Whether a keep-ratio-table entry is a public key: the hex of a PEM block, as
    ``bytes(NodeInfo.public_key).hex()`` gives it."""
    try:
        return bytes.fromhex(entry).lstrip().startswith(b"-----BEGIN")
    except ValueError:
        return False


def admit(policy: NodePolicy, caps: P.Capabilities,
          public_key: str = "") -> tuple[P.Capabilities | None, str]:
    """The capabilities to use under ``policy`` (``None``: refused) and what was changed or
    why the node was refused (empty: used as declared).

    ``public_key`` is the key Flower authenticated the node with (hex; empty where the grid
    reports none). A table entry is matched against it first; the declared ``node-key``
    selects an entry only when that entry is a name (not a public key), the node's own key
    is not listed, and ``policy.trust_declared_keys`` is set. A node whose declared key names
    another entry than its own public key's is refused."""
    table = policy.keep_ratio_table
    if table is not None:
        declared = caps.key
        if public_key and public_key in table:
            if declared != public_key and declared in table:
                return None, (f"declared node-key {_short(declared)!r} is another "
                              "keep-ratio-table entry than the public key this node "
                              f"authenticated with ({_short(public_key)}); a node may not "
                              "claim another's entry")
            bound = table[public_key]
        elif declared in table:
            if is_public_key(declared):
                return None, (f"declared node-key {_short(declared)!r} is a public key: only "
                              "a node that authenticated with it (SuperNode authentication) "
                              "gets its keep-ratio-table entry")
            if not policy.trust_declared_keys:
                return None, (f"declared node-key {declared!r} is in the keep-ratio table, but "
                              "declared names are not trusted (trust-declared-keys = false) "
                              "and no public key of this node is listed; list its public key "
                              "(SuperNode authentication), or set trust-declared-keys = true "
                              "where every node is known")
            bound = table[declared]
        else:
            return None, (f"node key {_short(declared)!r} is not in the keep-ratio table (nor "
                          "its public key); only listed nodes may train")
        if not math.isclose(caps.keep_ratio, bound, rel_tol=1e-9):
            return None, (f"declared keep ratio {caps.keep_ratio:g}, but the keep-ratio "
                          f"table binds node {_short(declared)!r} to {bound:g}")
    if caps.keep_ratio > policy.max_keep_ratio:
        return replace(caps, keep_ratio=policy.max_keep_ratio), (
            f"declared keep ratio {caps.keep_ratio:g} is above max_keep_ratio="
            f"{policy.max_keep_ratio:g}; it trains at {policy.max_keep_ratio:g}")
    return caps, ""


class NodeDirectory:
    """Connected nodes and their declared capabilities.

    Parameters
    ----------
    seed : int
        Root of the sampling stream ``default_rng([seed, round, 0])``.
    min_available_nodes : int
        Nodes that must be connected before a round starts.
    policy : fedshard.settings.NodePolicy or None
        The operator's keep-ratio cap and table and the timeouts (default: its defaults).
    sharded : bool
        Whether a keep ratio decides what a node is sent (``False`` for ``method = "none"``,
        where every node gets the dense model: no warning about a node's declared ratio).
    """

    def __init__(self, *, seed: int, min_available_nodes: int,
                 policy: NodePolicy | None = None, sharded: bool = True) -> None:
        self.seed = seed
        self.sharded = sharded
        self.min_available_nodes = min_available_nodes
        self.policy = policy if policy is not None else NodePolicy()
        self.capabilities: dict[int, P.Capabilities] = {}
        self._told_idle: set[int] = set()
        self.pool_size = 0  # the nodes the last sample was drawn from
        self._told_left_out: set[int] = set()
        self._asked_to_train = False  # the run's first training round has sampled

    #: Seconds between two "waiting for nodes" lines while a round waits.
    WAIT_LOG_EVERY_S = 60.0

    def wait(self, grid: Grid, need: int) -> list[int]:
        """Sorted ids of the connected nodes, once at least ``need`` are connected.

        While it waits it logs a WARNING at once and then every :attr:`WAIT_LOG_EVERY_S`
        seconds: how many nodes are connected, how many the round needs, which setting asks
        for them and how long it will still wait (``node_wait_timeout``, the run config's
        ``round-timeout``); past that it raises ``TimeoutError``.
        """
        start = time.monotonic()
        logged: float | None = None
        while len(node_ids := sorted(grid.get_node_ids())) < need:
            waited = time.monotonic() - start
            limit = self.policy.node_wait_timeout
            if limit is not None and waited > limit:
                raise TimeoutError(
                    f"Only {len(node_ids)} node(s) connected after {waited:.0f} s, but "
                    f"{need} are required (min_available_nodes/min nodes per round); stopping "
                    "the run. Start more SuperNodes or lower min-available-nodes."
                )
            if logged is None or waited - logged >= self.WAIT_LOG_EVERY_S:
                log(WARNING, "Waiting for nodes: %d connected, %d required by "
                    "min-available-nodes=%d (or the round's minimum); %s.", len(node_ids),
                    need, self.min_available_nodes,
                    "waiting without a limit" if limit is None
                    else f"the run stops in {max(0.0, limit - waited):.0f} s (round-timeout)")
                logged = waited
            time.sleep(1.0)
        return node_ids

    def sample(self, grid: Grid, server_round: int, fraction: float,
               minimum: int, *, training: bool = False,
               stop_if_all_fail: bool = False,
               leave_out: Mapping[int, str] | None = None) -> dict[int, P.Capabilities]:
        """Wait for enough nodes, learn the capabilities of new ones, then sample
        ``max(⌊fraction·K⌋, minimum)`` of the K connected among those with a keep ratio,
        returned in the canonical order (by stable key).

        With ``training``, nodes whose keep ratio is below the policy's ``min_keep_ratio``
        are idle: they are neither sampled nor counted in K. With ``stop_if_all_fail``, the
        run's first training round raises :class:`~fedshard.server.callbacks.NoRoundTrainedError`
        when every connected node answered the capability query with the same error.
        ``leave_out`` (node -> why; training only, e.g. the nodes ``exclude-distrusted`` left
        out) are neither sampled nor counted in K, each logged once; a round they leave with
        fewer than ``minimum`` nodes says so in a WARNING."""
        node_ids = self.wait(grid, max(self.min_available_nodes, minimum))
        for gone in set(self.capabilities) - set(node_ids):
            del self.capabilities[gone]
        first = training and stop_if_all_fail and not self._asked_to_train
        failures = self.query(grid, node_ids, defer_errors=first)
        if first:
            self._asked_to_train = True
            self._stop_if_all_failed(server_round, node_ids, failures)
            for node, reason in failures.items():  # they failed in different ways: as usual
                if reason.startswith("error reply"):
                    self._skipped(node, reason)
        if training and self.policy.min_keep_ratio > 0:
            node_ids = self._without_idle(server_round, node_ids)
        if training and leave_out:
            node_ids = self._without_left_out(server_round, node_ids, leave_out, minimum)
        # the nodes a round samples from (central DP's rate): a node without a keep ratio
        # (its capability query failed) can never be sampled, so it is not in the pool
        self.pool_size = sum(1 for n in node_ids if n in self.capabilities)
        eligible = sorted((n for n in node_ids if n in self.capabilities),
                          key=lambda n: (self.capabilities[n].key, n))
        size = min(len(eligible), max(int(len(node_ids) * fraction), minimum))
        if size < len(eligible):
            rng = stream_rng(self.seed, server_round, Stream.NODES)
            eligible = [eligible[i] for i in sorted(rng.choice(len(eligible), size, replace=False))]
        if len(eligible) < min(len(node_ids), max(int(len(node_ids) * fraction), minimum)):
            log(WARNING, "Round %d: only %d of %d connected nodes declared a usable keep ratio.",
                server_round, len(self.capabilities), len(node_ids))
        return {n: self.capabilities[n] for n in eligible}

    def _without_idle(self, server_round: int, node_ids: list[int]) -> list[int]:
        """``node_ids`` less the nodes below ``min_keep_ratio`` (each logged once)."""
        floor = self.policy.min_keep_ratio
        idle = [n for n in node_ids
                if n in self.capabilities and self.capabilities[n].keep_ratio < floor]
        for node in idle:
            if node not in self._told_idle:
                self._told_idle.add(node)
                log(INFO, "Node %d declares keep ratio %g, below min-keep-ratio=%g: it stays "
                    "idle (never sampled for training).", node,
                    self.capabilities[node].keep_ratio, floor)
        skipped = set(idle)
        busy = [n for n in node_ids if n not in skipped]
        if idle and not busy:
            log(WARNING, "Round %d: all %d connected node(s) declare a keep ratio below "
                "min-keep-ratio=%g, so no node trains this round; lower min-keep-ratio or "
                "start nodes that declare at least %g.", server_round, len(idle), floor, floor)
        return busy

    def _without_left_out(self, server_round: int, node_ids: list[int],
                          leave_out: Mapping[int, str], minimum: int) -> list[int]:
        """``node_ids`` less ``leave_out`` (each logged once, with why); a WARNING every round
        in which that leaves fewer than ``minimum`` nodes to train.

        Raises
        ------
        fedshard.server.callbacks.StopRun
            When every connected node is left out: no round could train again (one ERROR
            line; the model is the last trained round's)."""
        gone = [n for n in node_ids if n in leave_out]
        for node in gone:
            if node not in self._told_left_out:
                self._told_left_out.add(node)
                log(WARNING, "Round %d: node %d is left out of training from now on: %s.",
                    server_round, node, leave_out[node])
        busy = [n for n in node_ids if n not in leave_out]
        if gone and not busy:
            from fedshard.server.callbacks import StopRun  # (a cycle)

            message = (f"Round {server_round}: every one of the {len(node_ids)} connected "
                       f"nodes is left out of training (nodes "
                       f"{', '.join(map(str, gone[:10]))}{', ...' if len(gone) > 10 else ''}: "
                       f"{leave_out[gone[0]]}), so no round can train again: the run stops "
                       "here, and its model is the last trained round's (in the checkpoint). "
                       "Start nodes that are not left out and a new run, or start the run "
                       "again with exclude-distrusted = false (it cannot change on resume).")
            log(ERROR, "RUN FAILED: %s", message)
            stop = StopRun(message)
            stop.logged = True
            raise stop
        if gone and len(busy) < minimum:
            log(WARNING, "Round %d: leaving out %d distrusted node(s) (%s) leaves %d of the "
                "%d connected nodes to train, fewer than the %d the round needs "
                "(min-train-nodes); this round trains %d. Start more nodes, or set "
                "exclude-distrusted = false to train them again.", server_round, len(gone),
                ", ".join(map(str, gone[:10])), len(busy), len(node_ids), minimum, len(busy))
        return busy

    def _stop_if_all_failed(self, server_round: int, node_ids: list[int],
                            failures: dict[int, str]) -> None:
        """At the run's first training round: stop the run (one ERROR line
        with the error and the likely fix) when every connected node answered the capability
        query with the same error. That error would come back every round; nodes that fail
        differently, or only some nodes, are asked again next round as usual."""
        if not node_ids or set(failures) != set(node_ids) or self.capabilities:
            return
        reasons = set(failures.values())
        if len(reasons) != 1 or not (reason := next(iter(reasons))).startswith("error reply"):
            return
        from fedshard.server.callbacks import NoRoundTrainedError  # (a cycle)
        from fedshard.server.stops import likely_fix

        message = (f"No round trained: in round {server_round} every one of the "
                   f"{len(node_ids)} connected nodes answered the capability query with the "
                   f"same error, so every round would: the run stops here. The error: "
                   f"{one_line(reason, 2000)}")
        hint = likely_fix(reason)
        if hint:
            message += f" Likely fix: {hint}"
        log(ERROR, "RUN FAILED: %s", message)
        stop = NoRoundTrainedError(message)
        stop.logged = True
        raise stop

    @staticmethod
    def _skipped(node: int, reason: str) -> None:
        log(WARNING, "Node %d gave no usable keep ratio (%s); it is skipped this round and "
            "asked again next round.", node, one_line(reason, 600))

    def query(self, grid: Grid, node_ids: list[int], *,
              defer_errors: bool = False) -> dict[int, str]:
        """Ask every node not in the cache for its keep ratio (a ``query`` message); returns
        why each node that gave none did not (node -> reason). With ``defer_errors`` the
        nodes' error replies are not logged here (the caller says them once)."""
        failures: dict[int, str] = {}
        unknown = [n for n in node_ids if n not in self.capabilities]
        if not unknown:
            return failures
        messages = [P.query_message(node) for node in unknown]
        public_keys = self._public_keys(grid)
        answered: set[int] = set()
        to_node = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
        for reply in grid.send_and_receive(messages, timeout=self.policy.query_timeout):
            node = to_node.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
            answered.add(node)
            public_key = public_keys.get(node, "")
            caps, reason = P.read_capabilities(reply, default_key=public_key)
            if caps is not None:
                if reason:  # a memory reading that is dropped: the ratio stands
                    log(WARNING, "Node %d: %s.", node, one_line(reason, 600))
                caps, reason = admit(self.policy, caps, public_key)
            if caps is None:  # the reason may quote the node's own text: one escaped line
                failures[node] = reason
                if not (defer_errors and reason.startswith("error reply")):
                    self._skipped(node, reason)
                continue
            if reason:
                log(WARNING, "Node %d: %s.", node, one_line(reason, 600))
            if caps.memory_mb is not None:
                log(INFO, "Node %d: %s.", node, caps.memory_line())
            twin = next((n for n, c in self.capabilities.items()
                         if c.key == caps.key and n != node), None)
            self.capabilities[node] = caps
            if twin is not None:  # once: a cached node is not asked again
                log(WARNING, "Nodes %d and %d declare the same node-key %r: they get the same "
                    "training seed and the same random streams, and one may be posing as the "
                    "other; give every node its own key.", *sorted((twin, node)),
                    _short(caps.key, 80))
            if not self.sharded:
                continue
            if (self.policy.keep_ratio_table is None and not reason
                    and caps.keep_ratio >= self.policy.max_keep_ratio):
                log(WARNING, "Node %d declares keep ratio %g, the largest this run allows "
                    "(max-keep-ratio=%g), and no keep-ratio-table binds it: it is sent that "
                    "share of every sharded layer on its word alone. Bind nodes to their "
                    "ratios with keep-ratio-table (and SuperNode authentication) where that "
                    "matters.", node, caps.keep_ratio, self.policy.max_keep_ratio)
            elif caps.keep_ratio == 1.0:
                log(INFO, "Node %d declares keep ratio 1: it trains all N terms of every "
                    "sharded layer (the paper's r = 1 reference), not a shard.", node)
        for node in set(unknown) - answered:
            log(WARNING, "Node %d did not answer the capability query within %.0f s; it is "
                "skipped this round and asked again next round.", node,
                self.policy.query_timeout)
        return failures

    @staticmethod
    def _public_keys(grid: Grid) -> dict[int, str]:
        """Each connected node's public key as hex (``bytes(NodeInfo.public_key).hex()``);
        nodes without one are left out."""
        try:
            nodes = list(grid.get_nodes())
        except Exception:  # a grid without node details (some test grids) has no keys
            return {}
        keys = {}
        for info in nodes:
            try:
                key = bytes(info.public_key).hex()
            except (AttributeError, TypeError, ValueError):
                continue
            if key:
                keys[int(info.node_id)] = key
        return keys
