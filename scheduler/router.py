"""The workers the scheduler knows, learned from the registry's watch stream, and routing.

A worker that appears in the directory is dialled, described (GetInfo) and given a link; one
that leaves is drained. A request goes to a ready worker of its model:

- to the one holding the longest cached prefix of its prompt, among workers with room (no
  queue, and free blocks for the uncached part of the prompt after what already waits);
- otherwise to the one with the most free blocks left after the demand already waiting on it.

A request with a LoRA adapter goes only to workers that serve adapters (--max-loras > 0),
and first to those that already hold it (loaded, or for work queued there) while they have
room: loading an adapter is work the others would have to do first (scheduler/lora.py).

So shared prefixes stay on the worker that computed them until it fills, then spill over to
the next worker, which caches them too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc

from canteen.logging import get_logger
from canteen.streams import follow_stream
from canteen.tls import Tls, aio_channel, worker_channel_name
from canteen.v1 import registry_pb2, registry_pb2_grpc, worker_pb2, worker_pb2_grpc
from scheduler.batcher import BatchScheduler
from scheduler.failover import Failover
from scheduler.link import LinkSettings, StepObserver, WorkerDescription, WorkerLink, describe
from scheduler.lora import holds_adapter
from scheduler.sequence import Sequence
from scheduler.worker_limits import info_refusal, unlisted_model

log = get_logger(__name__)

# After the worker watch (re)connects, workers missing from the directory are not drained for
# this long: a restarted registry knows no lease until each worker's next heartbeat.
DIRECTORY_RESYNC_SECONDS = 15.0
# A worker refused because the registry could not confirm its model is dialled again after this.
RECHECK_SECONDS = 5.0


class WorkerPool:
    def __init__(
        self,
        registry_address: str,
        settings: LinkSettings,
        on_ready_change: Callable[[bool], Awaitable[None]],
        on_step: StepObserver | None = None,
        failover_wait: float = 30.0,
        tls: Tls | None = None,
    ) -> None:
        self._tls = tls
        self._settings = settings
        self._on_step = on_step
        self.failover = Failover(self._place, failover_wait)
        self._registry_address = registry_address
        self._on_ready_change = on_ready_change
        self.links: dict[str, WorkerLink] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._connecting: set[str] = set()
        self._was_ready = False
        self._synced_at: float | None = None  # when the current watch stream began
        self._was_broken = False  # the watch stream broke at least once (registry restart)
        self._live: dict[str, registry_pb2.WorkerEntry] = {}  # the directory's last word
        # Workers dialled and refused (worker_limits.py), with the entry and the reason: not
        # dialled again until the directory lists them differently.
        self.refused: dict[str, tuple[registry_pb2.WorkerEntry, str]] = {}

    def serving(self, model: str, version: str, with_adapters: bool = False) -> list[WorkerLink]:
        """Ready workers of the model (of that version, when given); ``with_adapters``:
        only those that serve LoRA adapters (--max-loras > 0)."""
        return [
            link
            for link in self.links.values()
            if link.is_ready
            and link.desc.model == model
            and (not version or link.desc.version == version)
            and (link.desc.max_loras > 0 or not with_adapters)
        ]

    @staticmethod
    def pick(
        candidates: list[WorkerLink], prompt_ids: list[int], salt: str = "", adapter_id: str = ""
    ) -> WorkerLink:
        chosen = pick_worker([link.core for link in candidates], prompt_ids, salt, adapter_id)
        assert chosen is not None, "pick needs at least one candidate"
        return candidates[chosen]

    def cancel(self, seq: Sequence) -> None:
        """Stops ``seq`` wherever it is: on a worker, or waiting for one after a failover."""
        if self.failover.cancel(seq):
            return
        link = self.links.get(seq.worker_id)
        if link is not None:
            link.cancel(seq)

    def _place(self, model: str, version: str, seq: Sequence) -> WorkerLink | None:
        total = len(seq.prompt_ids) + seq.max_tokens
        serving = self.serving(model, version, with_adapters=seq.adapter is not None)
        fitting = [link for link in serving if fits(link, total)]
        if not fitting:
            return None
        return self.pick(fitting, seq.tokens, seq.prefix_salt, seq.adapter_id)

    @property
    def num_waiting(self) -> int:
        return sum(len(link.core.waiting) for link in self.links.values())

    async def watch_forever(self) -> None:
        """Follows the registry's worker directory, reconnecting with backoff."""
        self._spawn(self.failover.expire_forever())
        await follow_stream(
            lambda: aio_channel(self._registry_address, self._tls, "registry"),
            lambda channel: registry_pb2_grpc.RegistryStub(channel).WatchWorkers(
                registry_pb2.WatchWorkersRequest()
            ),
            self._apply,
            "registry workers",
            self._watch_broken,
        )

    async def _watch_broken(self) -> None:
        self._synced_at, self._was_broken = None, True

    async def _apply(self, snapshot: registry_pb2.WorkerList) -> None:
        live = {w.worker_id: w for w in snapshot.workers}
        self._live = live
        self._synced_at = self._synced_at or time.monotonic()
        for worker_id, link in self.links.items():
            if not link.is_draining and not self._listed(worker_id, link.desc.address):
                log.info(
                    "worker left the directory",
                    worker_id=worker_id,
                    address=link.desc.address,
                    listed_at=live[worker_id].address if worker_id in live else None,
                )
                link.drain()  # once it ends, a new address is dialled (_connect)
        for worker_id in [w for w, (entry, _) in self.refused.items() if live.get(w) != entry]:
            del self.refused[worker_id]  # gone, or registered anew: judged again
        for worker_id, entry in live.items():
            if worker_id in self.refused:
                continue
            if worker_id not in self.links and worker_id not in self._connecting:
                self._spawn(self._connect(entry))

    def _listed(self, worker_id: str, address: str) -> bool:
        """Whether the directory lists ``worker_id`` at ``address``. An id it lists nowhere
        counts as listed for DIRECTORY_RESYNC_SECONDS after the watch reconnects (a
        restarted registry knows no lease until each worker's next heartbeat), and while
        the watch is down; an id listed at another address is never this one."""
        live = self._live.get(worker_id)
        if live is not None:
            return live.address == address
        if not self._was_broken:
            return False
        synced = self._synced_at
        return synced is None or time.monotonic() - synced < DIRECTORY_RESYNC_SECONDS

    async def _connect(self, entry: registry_pb2.WorkerEntry, patient: bool = True) -> None:
        """Dials a worker and runs its link until it ends. ``patient`` waits up to 10 s for
        a worker that is still starting; a re-dial after a loss fails fast instead, so a dead
        address never blocks the worker's restart under the same id."""
        self._connecting.add(entry.worker_id)
        # Under mTLS the worker must present the certificate of the id the registry lists.
        channel = aio_channel(entry.address, self._tls, worker_channel_name(entry.worker_id))
        try:
            info = await worker_pb2_grpc.WorkerStub(channel).GetInfo(
                worker_pb2.GetInfoRequest(), timeout=10 if patient else 2, wait_for_ready=patient
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("worker unreachable", worker_id=entry.worker_id, code=exc.code().name)
            await channel.close()
            self._connecting.discard(entry.worker_id)
            self._dial_if_moved(entry)  # it re-registered elsewhere meanwhile
            return
        try:  # still connecting while it is judged: no second dial meanwhile
            desc = describe(info, entry.address)
            refusal, transient = info_refusal(desc, entry), False
            if refusal is None:
                refusal, transient = await self._model_refusal(desc)
        finally:
            self._connecting.discard(entry.worker_id)
        if refusal is not None:
            self._refuse(entry, refusal, transient)
            await channel.close()
            return
        link = WorkerLink(
            desc,
            channel,
            self._settings,
            self._on_step,
            self.failover.on_lost,
        )
        self.links[entry.worker_id] = link
        if not self._listed(entry.worker_id, entry.address):
            # It left the directory (a worker stopped as it started) or moved while it was
            # dialled: no directory change is coming to drain it, and an idle link never
            # reads its stream, so it would be listed and routed to for good.
            log.info("worker left the directory while dialled", worker_id=entry.worker_id)
            link.drain()
        self.failover.retry()
        log.info(
            "worker connected",
            worker_id=entry.worker_id,
            address=entry.address,
            model=info.model,
            version=info.version,
            num_blocks=info.num_blocks,
        )
        await self._readiness_changed()
        await link.run()
        if self.links.get(entry.worker_id) is link:
            del self.links[entry.worker_id]
        await self._readiness_changed()
        if link.is_draining:
            self._dial_if_moved(entry)  # drained because it moved: dial the new address
        else:
            self._spawn(self._reconnect(entry))

    def _dial_if_moved(self, entry: registry_pb2.WorkerEntry) -> None:
        """Dials ``entry``'s worker id where the directory lists it now, if that is another
        address and nothing links or dials the id already."""
        worker_id = entry.worker_id
        moved = self._live.get(worker_id)
        if (
            moved is not None
            and moved.address != entry.address
            and worker_id not in self.links
            and worker_id not in self._connecting
        ):
            self._spawn(self._connect(moved))

    async def _model_refusal(self, info: WorkerDescription) -> tuple[str | None, bool]:
        """Why the registry's model list rules the worker's model version out; None when it
        lists it; and whether the refusal is transient (the registry could not answer)."""
        request = registry_pb2.GetModelRequest(name=info.model, version=info.version)
        async with aio_channel(self._registry_address, self._tls, "registry") as channel:
            try:
                await registry_pb2_grpc.RegistryStub(channel).GetModel(request, timeout=10)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return unlisted_model(info), False
                return (
                    f"model={info.model!r} version={info.version!r}: the registry could not "
                    f"confirm it is listed ({exc.code().name}); asking again in "
                    f"{RECHECK_SECONDS:g} s"
                ), True
        return None, False

    def _refuse(self, entry: registry_pb2.WorkerEntry, reason: str, transient: bool) -> None:
        log.warning(
            "worker refused", worker_id=entry.worker_id, address=entry.address, reason=reason
        )
        self.refused[entry.worker_id] = (entry, reason)
        if transient:
            self._spawn(self._recheck(entry))

    async def _recheck(self, entry: registry_pb2.WorkerEntry) -> None:
        await asyncio.sleep(RECHECK_SECONDS)
        if self.refused.get(entry.worker_id, (None, ""))[0] == entry:
            del self.refused[entry.worker_id]
            self._spawn(self._connect(entry))

    async def _reconnect(self, entry: registry_pb2.WorkerEntry) -> None:
        """Dials a lost worker again while the directory still lists it: its process may
        have survived what broke the stream (a failed step), or come back on its address."""
        delay = 0.5
        while entry.worker_id in self._live and entry.worker_id not in self.links:
            await asyncio.sleep(delay)
            live = self._live.get(entry.worker_id)
            if live is None or entry.worker_id in self.links or live.worker_id in self._connecting:
                return
            await self._connect(live, patient=False)
            return

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _readiness_changed(self) -> None:
        is_ready = any(link.is_ready for link in self.links.values())
        if is_ready != self._was_ready:
            self._was_ready = is_ready
            await self._on_ready_change(is_ready)


def pick_worker(
    cores: list[BatchScheduler], prompt_ids: list[int], salt: str = "", adapter_id: str = ""
) -> int | None:
    """Index of the core to run on: among those holding ``adapter_id`` with room when
    there are any, prefix-cache affinity among those with room, else the most headroom."""
    if not cores:
        return None
    indices = list(range(len(cores)))
    if adapter_id:
        need = cores[0].pool.blocks_for(len(prompt_ids))
        holders = [
            i
            for i in indices
            if holds_adapter(cores[i], adapter_id) and _headroom(cores[i]) >= need
        ]
        indices = holders or indices
    best: tuple[int, int] | None = None
    chosen = None
    for i in indices:
        core = cores[i]
        cached = core.kv.count_cached_prefix(prompt_ids, salt)  # pool and tiers
        room = _headroom(core) - (core.pool.blocks_for(len(prompt_ids)) - cached)
        if cached and room >= 0 and not core.waiting and (best is None or (cached, room) > best):
            best, chosen = (cached, room), i
    if chosen is not None:
        return chosen
    return max(indices, key=lambda i: _headroom(cores[i]))


def fits(link: WorkerLink, total_tokens: int) -> bool:
    """Whether prompt + max_tokens = ``total_tokens`` can ever run on ``link``'s worker."""
    desc = link.desc
    return (
        total_tokens <= desc.max_model_len
        and link.core.pool.blocks_for(total_tokens) <= desc.num_blocks
    )


def _headroom(core: BatchScheduler) -> int:
    waiting_demand = sum(core.pool.blocks_for(s.num_tokens) for s in core.waiting)
    return core.pool.num_free - waiting_demand
