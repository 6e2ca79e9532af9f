"""When the offloaded optimizer state is in RAM: `ShardRunner`'s contexts for whatever reads or
writes it from outside the step ([Note: offload] in `zero_kernels.offload`).

- `resident`: everything in RAM (state dicts, ``full_state``, loads of int8 codes kept in RAM);
- `window`: one bucket's offloaded state at a time, for checkpoints ([Note: streamed
  checkpoints] in `zero_kernels.checkpoint.save`), int8 moments included: a save reads their
  codes as they are (`codes_resident`, `_codes_window`), a load decodes and encodes back a bucket
  at a time (`_decoded_window`; [Note: int8 shard state] in `.lowbit_state`).

A mixin of `ShardRunner`: the attributes it uses are the runner's (``store``, ``swap``,
``int8``, ``inner``, ``flat_state``, ``_resident``, ``_decoded``, ...).
"""

from __future__ import annotations

import contextlib

import torch

from .lowbit_state import INT8_KEYS

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # fused Adam's flat state


class Residency:
    @contextlib.contextmanager
    def resident(self):
        """The offloaded state in RAM for the duration (state dicts, checkpoints, full_state,
        loads), written back to the files after: the moments ([Note: offload]) and the param
        shards ([Note: param offload] in `zero_kernels.offload.params`); nothing to do without
        offload. Reentrant."""
        with self.store.resident(), self._moments_resident(), self._int8_decoded():
            yield

    @contextlib.contextmanager
    def _int8_decoded(self):
        """int8 state: decoded to fp32 views in torch's format for the duration, encoded back
        where it changed ([Note: int8 shard state])."""
        if self.int8 is None or self._decoded:
            self._decoded += self.int8 is not None
            try:
                yield
            finally:
                self._decoded -= self.int8 is not None
            return
        self._decoded = 1
        self.flat_state.clear()
        try:
            self._repoint()
            yield
        finally:
            self._decoded = 0
            try:
                self.int8.leave_resident()
            finally:
                self.flat_state.clear()
                self._repoint()

    def _repoint(self, only=None) -> None:
        """Every fused piece with state (of the buckets ``only``, a set of (i, b), if given):
        its entries as views of what the runner holds now (int8 outside `_int8_decoded`: codes
        and scales; else the flat moments, fp32 decoded ones for int8), the other form's
        entries removed."""
        codes = self.int8 is not None and not self._decoded
        for i, k, pc, p, _ in self.all_pieces():
            st = self.inner.state.get(p)
            if not (self.fused[i] and st) or (only is not None and (i, pc.bucket) not in only):
                continue
            lo = pc.start - self.layout.buffers[i].buckets[pc.bucket].shard_start(self.rank)
            if codes:
                for name in ADAM_KEYS:
                    st.pop(name, None)
                st.update(self.int8.piece_views(i, k, pc, lo))
                continue
            for name in (*INT8_KEYS, "state_block"):
                st.pop(name, None)
            flat = self._flat_state(i, pc.bucket, self.inner.param_groups[i])
            for name, t in flat.items():
                st[name] = t[lo : lo + pc.numel].view(p.shape)

    @contextlib.contextmanager
    def codes_resident(self):
        """int8 state: the offloaded param shards and the moments' codes and scales in RAM for
        the duration, not decoded, nothing written back: what a checkpoint save reads ([Note:
        int8 shard state]); 2 bytes per element of the shard, not the decoded copy's 8."""
        with self.store.resident(), self._moments_resident(write=False):
            yield

    @contextlib.contextmanager
    def _moments_resident(self, write: bool = True):
        if self.swap is None or self._resident:
            self._resident += self.swap is not None
            try:
                yield
            finally:
                self._resident -= self.swap is not None
            return
        sw = self.swap
        self._resident = 1
        try:
            for i, b in sw.records:
                sw.read_into(i, b, {n: self._state_view(i, b, n) for n in sw.names[i]})
            self._repoint()  # pieces with state: their views again
            yield
            for i, b in sw.records if write else ():
                self._check_names(i, b)
                sw.write_from(i, b, {n: self._state_view(i, b, n) for n in sw.names[i]})
        finally:
            self._leave_resident()

    def _check_names(self, i: int, b: int) -> None:
        extra = set(self.flat_state.get((i, b), {})) - set(self.swap.names[i])
        if extra:
            self._refuse_names(extra)

    @staticmethod
    def _refuse_names(extra: set) -> None:
        raise ValueError(
            f"state {sorted(extra)} was loaded into an optimizer built without it "
            "and offload_optimizer='nvme' (amsgrad set after construction?): build "
            "it with the same amsgrad"
        )

    def streams(self, write: bool = True) -> bool:
        """Whether `window` holds less than `resident`: offloaded state, not in RAM already
        (inside `resident`), and not int8 moments kept in RAM that may be written (those are
        decoded whole; offloaded ones a bucket at a time)."""
        offloaded = self.swap is not None or self.store.tier is not None
        inside = self._resident or self._decoded
        in_ram = self.int8 is not None and self.swap is None and write  # decoded whole
        return offloaded and not inside and not in_ram

    @contextlib.contextmanager
    def window(self, buckets, read: bool = True, write: bool = True):
        """The offloaded state of ``buckets`` ((i, b) each) alone in RAM for the duration
        (checkpoints stream the state bucket by bucket: [Note: streamed checkpoints] in
        `zero_kernels.checkpoint.save`): the param shards and fp32 masters (``read`` only) and
        the moments read in (``read``; else zeros: only their names, dtypes and shapes are
        looked at), written back after (``write``); offloaded int8 moments: read only, their
        codes and scales, never decoded; else decoded and encoded back a bucket at a time.
        Where it cannot hold less than `resident` (int8 moments in RAM to write, already
        resident, nothing offloaded) it is `resident` (`codes_resident` for an int8 save)."""
        codes = self.int8 is not None and not write
        if not self.streams(write) or self._resident or self._decoded:
            with self.codes_resident() if codes else self.resident():
                yield
            return
        keys, tier, held = list(buckets), self.store.tier, []
        try:
            if tier is not None and read:
                for i, b in keys:
                    for k in ((i, b), (i, b, "master")):
                        if k in tier:
                            tier.acquire(k, learn=False)
                            held.append(k)
            if codes:
                moments = self._codes_window(keys, read)
            elif self.int8 is not None:
                moments = self._decoded_window(keys, read, write)
            else:
                moments = self._moments_window(keys, read, write)
            with moments:
                yield
        finally:
            for k in held:
                tier.release(k, dirty=write)
            if held:
                tier.flush()

    def _note_window(self, *parts: dict) -> None:
        """`window_peak_bytes`: the most a window held at once (``parts``: per bucket, a dict
        of its tensors)."""
        held = sum(
            t.numel() * t.element_size() for p in parts for h in p.values() for t in h.values()
        )
        self.window_peak_bytes = max(self.window_peak_bytes, held)

    @contextlib.contextmanager
    def _codes_window(self, keys, read: bool):
        """int8 moments offloaded, read only: the codes and scales of ``keys``' buckets alone
        in RAM (zeros unless ``read``), the pieces' entries views of them."""
        sw = self.swap
        if sw is None:  # the codes are in RAM
            yield
            return
        keys = [k for k in keys if k in sw.records]
        self._resident = 1
        try:
            for i, b in keys:
                held = self.int8.hold(i, b)
                if read:
                    sw.read_into(i, b, held)
            self._note_window(self.int8.held)
            self._repoint(set(keys))
            yield
        finally:
            self.int8.release()
            self._leave_resident()

    @contextlib.contextmanager
    def _decoded_window(self, keys, read: bool, write: bool):
        """int8 moments, to be written (a streamed load): offloaded, the codes of ``keys``'
        buckets read in and decoded, the pieces' entries fp32 views of the decode, encoded
        back where changed and written after (``write``); else the moments are `resident`'s."""
        sw = self.swap
        if sw is None:
            with self._int8_decoded():
                yield
            return
        keys = [k for k in keys if k in sw.records]
        self._resident, self._decoded = 1, 1
        self.flat_state.clear()
        try:
            for i, b in keys:
                held = self.int8.hold(i, b)
                if read:
                    sw.read_into(i, b, held)
                self.int8.decode_held(i, b)
            self._note_window(self.int8.held, self.int8.held_decoded)
            self._repoint(set(keys))
            yield
            if write:
                for i, b in keys:
                    self.int8.encode_held(i, b)
                    sw.write_from(i, b, self.int8.held[(i, b)])
        finally:
            self.int8.release()
            self._decoded = 0
            self._leave_resident()

    @contextlib.contextmanager
    def _moments_window(self, keys, read: bool, write: bool):
        sw = self.swap
        if sw is None:
            yield
            return
        keys = [k for k in keys if k in sw.records]
        dt = torch.bfloat16 if self.state_dtype == "bf16" else torch.float32
        self._resident, self._window = 1, {}
        try:
            for i, b in keys:
                n = self.layout.buffers[i].buckets[b].shard_numel
                out = {
                    name: torch.zeros(n, dtype=dt, device=self.store.device) for name in sw.names[i]
                }
                self._window[(i, b)] = out
                if read:
                    sw.read_into(i, b, out)
            self._note_window(self._window)
            self._repoint(set(keys))
            yield
            if write:
                for i, b in keys:
                    self._check_names(i, b)
                    sw.write_from(i, b, self._window[(i, b)])
        finally:
            self._window = None
            self._leave_resident()

    def _leave_resident(self) -> None:
        """The moments leave RAM: the pieces' views of them are dropped."""
        self._resident = 0
        self._state_whole.clear()
        self.flat_state.clear()
        if self.int8 is not None:  # the codes and scales back on disk only
            self.int8.whole.clear()
        for i, _k, _pc, p, _ in self.all_pieces():
            st = self.inner.state.get(p)
            if self.fused[i] and st:
                for name in (*ADAM_KEYS, *INT8_KEYS, "state_block"):
                    st.pop(name, None)
