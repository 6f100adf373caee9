"""``cfx.serve.Engine``: many requests decoded at once over a paged KV cache.

    engine = cfx.serve.Engine(model, params, block_size=16, kv_bytes=256 << 20, max_batch_tokens=512)
    rid = engine.add_request(prompt_ids, cfx.serve.SamplingParams(max_tokens=64))
    while engine.has_unfinished():
        for out in engine.step():          # StepOutput: request id, sample index, token, finished
            ...
    engine.generate([prompt_a, prompt_b], SamplingParams(...))  # every request run to its end

Requests join and leave between steps (continuous batching, ``scheduler``); their keys and values
live in one preallocated pool of blocks (``paged``), each sequence holding a table of them, shared
where prompts share a prefix (``blocks``: the prefix cache) and between the ``n`` samples of one
prompt (copied on write). A step runs the model at most twice -- once over the decoding rows, one
token each, once over the prefill chunks, right-padded to the longest -- and computes logits only at
the last token of each row that needs its next token.

Every request computes what it would alone: greedy tokens equal ``cfx.generate`` on that request by
itself, and sampled ones depend on the request's seed alone (``request``), whatever it is batched
with, whenever it arrives, and if it is preempted and recomputed.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Iterable, Sequence as Seq

import torch

from cfx._src.core import tree as tree_util
from cfx._src.generate.pick import whole_vocab
from cfx._src.mesh.spec import P
from cfx._src.models.parts import hook, max_length, vocab_size
from cfx._src.serve.adapters import Adapters
from cfx._src.serve.blocks import BlockAllocator
from cfx._src.serve import ranks
from cfx._src.serve.paged import KVPool, PagedStep
from cfx._src.serve.ranks import Control
from cfx._src.serve.request import SamplingParams, Sequence, Status, StepOutput, check_prompt
from cfx._src.serve.scheduler import Scheduler

WHERE = "cfx.serve.Engine"


class Engine:
    """Continuous batching over a paged KV cache (module doc). ``num_blocks`` blocks of ``block_size``
    tokens, or as many as ``kv_bytes`` holds (default: 256 MiB, or what ``max_seqs`` full contexts
    need if less); at most ``max_batch_tokens`` tokens computed per step and ``max_seqs`` sequences
    running; ``prefix_caching`` reuses the blocks of prompts' common prefixes; ``eos_id`` defaults to
    the model's config's ``eos_token_id``; ``mesh``: a ``model`` axis splits the heads over its ranks
    (rank threads of this process, or under torchrun a process each: rank 0 ``step``s, the others
    ``cfx.serve.follow``); ``attention``: ``"triton"`` reads the blocks in place (``cfx_kernels.paged_attention``),
    ``"reference"`` gathers them, ``"auto"`` the kernel on CUDA (blocks of a power-of-two size >= 16)."""

    def __init__(self, model: Any, params: Any, *, block_size: int = 16, num_blocks: int | None = None,
                 kv_bytes: int | None = None, max_batch_tokens: int = 512, max_seqs: int = 64,
                 prefix_caching: bool = True, eos_id: int | None = None, mesh: Any = None, attention: str = "auto"):
        if not isinstance(getattr(model, "blocks", None), tuple) or hook(model, "config") is None \
                or not callable(hook(model, "hidden")) or not callable(hook(model, "logits")):
            raise ValueError(f"{WHERE}: {type(model).__name__} is not a decoder language model (a config, a tuple of "
                             "blocks, hidden() and logits(), as cfx.models' GPT-2, Llama, OPT and Mixtral).")
        if max_batch_tokens < max_seqs:
            raise ValueError(f"{WHERE}: max_batch_tokens={max_batch_tokens} < max_seqs={max_seqs}; every running "
                             "sequence needs a token of the budget per step.")
        if num_blocks is not None and kv_bytes is not None:
            raise ValueError(f"{WHERE}: give num_blocks or kv_bytes, not both.")
        self.model, self.params = model, params
        config = hook(model, "config")
        self.max_len = max_length(model)
        self.vocab_size = vocab_size(model)  # (a padded vocabulary's real ids)
        self.eos_id = getattr(config, "eos_token_id", None) if eos_id is None else eos_id
        device = next(x.device for x in tree_util.leaves(params) if isinstance(x, torch.Tensor))
        self.block_bytes = _block_bytes(model, params, block_size, device)  # the whole model's, per block
        if attention not in ("auto", "triton", "reference"):
            raise ValueError(f"{WHERE}: attention must be 'auto', 'triton' or 'reference', got {attention!r}.")
        self.run = Forward(model, params, mesh, attention)  # one device, or each rank its heads
        self.adapters = Adapters(params if mesh is None else None)  # (a mesh: none served)
        self.block_bytes //= self.run.n  # what one rank holds
        if num_blocks is None:
            num_blocks = (kv_bytes or 256 << 20) // self.block_bytes
            if kv_bytes is None:  # the default: no more than max_seqs full contexts need
                num_blocks = min(num_blocks, max_seqs * math.ceil((self.max_len or 4096) / block_size))
        if num_blocks < 1:
            raise ValueError(f"{WHERE}: kv_bytes={kv_bytes} holds no block of {self.block_bytes} bytes "
                             f"({block_size} tokens over every layer); give more.")
        self.blocks = BlockAllocator(num_blocks, block_size, prefix_caching=prefix_caching)
        self.pools = self.run.pools(num_blocks, block_size)
        self.scheduler = Scheduler(self.blocks, max_batch_tokens=max_batch_tokens, max_seqs=max_seqs)
        self.seqs: dict[str, list[Sequence]] = {}
        self._forks: dict[str, list[Sequence]] = {}  # samples 1..n-1, started from sample 0's prompt
        self._arrivals = itertools.count()
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "preemptions": 0, "occupancy": []}

    # -- requests -------------------------------------------------------------------------------------
    def add_request(self, prompt: Seq[int] | torch.Tensor, params: SamplingParams | None = None, *,
                    request_id: str | None = None) -> str:
        """Queue ``prompt`` (token ids) to be decoded as ``params`` say; returns its id."""
        rid = self.reserve_request(prompt, params, request_id=request_id)
        self.start_request(rid)
        return rid

    def add_adapter(self, name: str, adapters: Any, config: Any) -> None:
        """Serve LoRA ``adapters`` (``cfx.lora.init`` / ``load_peft``'s, made with ``config``) as ``name``:
        requests with ``SamplingParams(lora=name)`` run under them, batched with any others (``adapters``)."""
        if self.run.mesh is not None:
            raise ValueError(f"{WHERE}: LoRA adapters are served on one device; drop mesh= to serve them.")
        self.adapters.add(name, adapters, config)

    def reserve_request(self, prompt: Seq[int] | torch.Tensor, params: SamplingParams | None = None, *,
                        request_id: str | None = None) -> str:
        """``add_request``'s checks and id, without queueing it yet (``start_request``): a server checks
        a request on its own thread and hands it to the engine's."""
        params = SamplingParams() if params is None else params
        params.check(WHERE)
        self.adapters.index(params.lora)  # a name the engine serves
        prompt = check_prompt(prompt, self.vocab_size, self.max_len, params.max_tokens, WHERE)
        if math.ceil((len(prompt) + params.max_tokens) / self.blocks.block_size) > self.blocks.num_blocks:
            raise ValueError(f"{WHERE}: {len(prompt)} prompt + {params.max_tokens} new tokens need more than the "
                             f"pool's {self.blocks.num_blocks} blocks of {self.blocks.block_size}; give more kv_bytes.")
        arrival = next(self._arrivals)
        rid = str(arrival) if request_id is None else str(request_id)
        if rid in self.seqs:
            raise ValueError(f"{WHERE}: request id {rid!r} is in use.")
        seqs = [Sequence(rid, j, prompt, params, arrival, root=Adapters.root(params.lora)) for j in range(params.n)]
        self.seqs[rid] = seqs
        self._forks[rid] = seqs[1:]
        return rid

    def start_request(self, request_id: str) -> None:
        """Queue a reserved request: it joins the batch at a coming step."""
        seqs = self.seqs[str(request_id)]
        if seqs[0].status is Status.WAITING and seqs[0].finish_reason is None:
            self.scheduler.add(seqs[0])

    def abort(self, request_id: str) -> None:
        """Stop a request now: its samples finish (reason ``abort``) and give their blocks back."""
        for seq in self.seqs.get(str(request_id), ()):
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        self._forks.pop(str(request_id), None)

    def forget(self, request_id: str) -> None:
        """Drop a finished (or aborted) request's record (a server does, once it has answered)."""
        seqs = self.seqs.get(str(request_id), ())
        assert all(s.status is Status.FINISHED for s in seqs), f"request {request_id} is still running"
        self.seqs.pop(str(request_id), None)
        self._forks.pop(str(request_id), None)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def output(self, request_id: str) -> list[list[int]]:
        """The tokens each sample of a request produced so far."""
        return [list(s.output) for s in self.seqs[str(request_id)]]

    # -- one step -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Schedule, run the model over the scheduled tokens, pick each finished row's next token."""
        if self.run.control is not None and not self.run.control.leader:
            raise ValueError(f"{WHERE}: rank {self.run.control.rank} of a torchrun mesh follows rank 0's steps; "
                             "call cfx.serve.follow(engine) there and step() on rank 0 only.")
        plan = self.scheduler.schedule()
        self.stats["preemptions"] += len(plan.preempted)
        if plan.copies:
            self.run.copy_blocks(self.pools, plan.copies)
        if not plan.rows:
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError(f"{WHERE}: no request fits the KV pool (every block held by nothing running).")
            return []
        decode = [(s, n) for s, n in plan.rows if n == 1]
        prefill = [(s, n) for s, n in plan.rows if n > 1]
        logits = {}
        for group in (decode, prefill):
            if group:
                logits.update(self._run(group))
        out = []
        for seq, n in plan.rows:
            seq.computed += n
            self.stats["prefill_tokens" if seq.computed <= len(seq.prompt) else "decode_tokens"] += n
            self.scheduler.register_full_blocks(seq)
            if seq in logits:
                out += self._advance(seq, logits[seq])
        self._occupancy()
        self.stats["steps"] += 1
        return out

    def _run(self, rows: list[tuple[Sequence, int]]) -> dict:
        """The model over ``rows``: ``{sequence: (last logits, greedy token)}`` of those whose every token is
        then computed (``Forward.rows``), each row under its own adapter."""
        params = self.adapters.params_for(torch.tensor([self.adapters.index(s.params.lora) for s, _ in rows]))
        return self.run.rows(self.pools, rows, self.blocks.block_size, self.max_len, params)

    def _advance(self, seq: Sequence, logits: tuple[torch.Tensor, int]) -> list[StepOutput]:
        """``seq``'s next token from its last ``(logits, greedy token)``; on finishing its prompt, sample 0
        forks the others."""
        out = [self._emit(seq, logits)]
        forks = self._forks.pop(seq.request_id, []) if seq.index == 0 else []
        for child in forks:  # the prompt's blocks shared (copied when written), the first token their own
            for b in seq.table:
                self.blocks.share(b)
            child.table, child.hashes = list(seq.table), list(seq.hashes)
            child.computed, child.registered, child.status = len(seq.prompt), seq.registered, Status.RUNNING
            self.scheduler.running.append(child)
            out.append(self._emit(child, logits))
        return out

    def _emit(self, seq: Sequence, logits: tuple[torch.Tensor, int]) -> StepOutput:
        tok = logits[1] if seq.params.temperature == 0 else seq.pick(self.model, logits[0])
        seq.output.append(tok)
        p = seq.params
        reason = None
        if tok in p.stop_token_ids or (not p.ignore_eos and self.eos_id is not None and tok == self.eos_id):
            reason = "stop"
        elif len(seq.output) >= p.max_tokens:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq)
            seq.finish_reason = reason
        return StepOutput(seq.request_id, seq.index, tok, reason is not None, reason)

    def _occupancy(self) -> None:
        """Token slots holding tokens / slots reserved by the running sequences (``kv_utilisation``);
        a block shared by several counts once."""
        bs, filled = self.blocks.block_size, {}
        for s in self.scheduler.running:
            full, part = divmod(s.computed, bs)
            filled.update(dict.fromkeys(s.table[:full], bs))  # (a full block holds the most a block can)
            for b in s.table[full:]:
                filled[b], part = max(filled.get(b, 0), part), 0
        if filled:
            self.stats["occupancy"].append(sum(filled.values()) / (len(filled) * bs))

    # -- everything at once -------------------------------------------------------------------------
    def generate(self, prompts: Iterable[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[list[list[int]]]:
        """Every prompt run to its end (added at once); each request's samples' new tokens, in order."""
        prompts = list(prompts)
        each = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, each)]
        while self.has_unfinished():
            self.step()
        return [self.output(i) for i in ids]


class Forward:
    """The model over one step's rows: on one device, or with a mesh's ``model`` axis inside
    ``shard_map`` (``cfx.parallel.tensor_parallel``: each rank computes, caches and keeps its own heads'
    keys and values -- a pool per rank, the same block tables -- and the vocabulary-parallel logits are
    gathered, so every rank picks the same tokens)."""

    def __init__(self, model: Any, params: Any, mesh: Any, impl: str = "auto"):
        self.mesh, self.model, self.params, self.n, self.impl = mesh, model, params, 1, impl
        self.control = None
        if mesh is None:
            return
        if set(mesh.axis_names) != {"model"}:
            raise ValueError(f"{WHERE}: the mesh {dict(mesh.shape)} must have one axis, 'model' (tensor parallelism; "
                             "each rank its heads). Serve data-parallel replicas as separate engines.")
        from cfx._src.parallel.megatron import MEGATRON_RULES, tensor_parallel
        from cfx._src.parallel.rules import Rules
        from cfx._src.spmd.arrays import device_put

        self.n = mesh.shape["model"]
        self.model = tensor_parallel(model, "model")
        self.specs = Rules(MEGATRON_RULES).specs(model.axes(), mesh=mesh)
        self.params = device_put(params, mesh, self.specs)
        self.control = Control() if ranks.needed(mesh) else None  # (a process per rank: rank 0 leads)

    def rows(self, pools: dict, rows: list[tuple[Sequence, int]], bs: int, max_len: int | None, params: Any) -> dict:
        """The model over ``rows`` (each its next ``n`` tokens, right-padded): ``{sequence: (last logits,
        greedy token)}`` of the rows whose every token is then computed (the greedy ones picked at once)."""
        T, nb = max(n for _, n in rows), max(math.ceil((s.computed + n) / bs) for s, n in rows)
        tokens = torch.tensor([s.span(s.computed, n) + [0] * (T - n) for s, n in rows])
        starts = torch.tensor([s.computed for s, _ in rows])
        lengths = torch.tensor([n for _, n in rows])
        tables = torch.tensor([s.table[:nb] + [0] * (nb - len(s.table[:nb])) for s, _ in rows])  # (padded: any block)
        positions = starts[:, None] + torch.arange(T)[None, :]
        if max_len is not None:
            positions = positions.clamp(max=max_len - 1)  # padding's positions: any in range
        done = [b for b, (s, n) in enumerate(rows) if s.computed + n == s.length]
        if not done:  # every row a chunk of a longer prompt: its keys and values, no logits
            self(pools, tokens, positions, tables, starts, lengths, None, params)
            return {}
        logits = self(pools, tokens, positions, tables, starts, lengths, torch.tensor(done), params)
        greedy = logits.argmax(-1).tolist()
        return {rows[b][0]: (logits[r], greedy[r]) for r, b in enumerate(done)}

    def pools(self, num_blocks: int, block_size: int) -> dict[int, KVPool]:
        """A pool per rank this process runs (one, without a mesh)."""
        ranks = [0] if self.mesh is None else list(self.mesh.local_ranks)
        return {r: KVPool(num_blocks, block_size, len(self.model.blocks)) for r in ranks}

    def copy_blocks(self, pools: dict, copies: list[tuple[int, int]]) -> None:
        """Each ``(src, dst)`` block copied in every pool (every rank's, where rank 0 leads)."""
        if self.control is not None and self.control.leader:
            self.control.send("copy", torch.tensor(copies, dtype=torch.long).reshape(-1, 2))
        for src, dst in copies:
            for pool in pools.values():
                pool.copy_block(src, dst)

    def follow(self, pools: dict) -> None:
        """A follower's loop (``cfx.serve.follow``): what rank 0 sends, done here, until it sends ``stop``."""
        while True:
            kind, *args = self.control.recv()
            if kind == "stop":
                return
            if kind == "copy":
                self.copy_blocks(pools, [tuple(pair) for pair in args[0].tolist()])
            else:
                self(pools, *args)

    def __call__(self, pools: dict, tokens, positions, tables, starts, lengths, done, params: Any = None
                 ) -> torch.Tensor | None:
        """The last logits ``(R, V)`` of the rows ``done`` (None: none wanted, the keys and values written);
        ``params``: this step's (adapters attached), else the model's."""
        if self.control is not None and self.control.leader:
            self.control.send("rows", tokens, positions, tables, starts, lengths, done)
        if self.mesh is None:
            return self._rows(pools[0], self.params if params is None else params, tokens, positions, tables, starts,
                              lengths, done)
        from cfx._src.mesh.context import current
        from cfx._src.spmd.arrays import device_get
        from cfx._src.spmd.shard_map import shard_map

        def body(p, *xs):
            out = self._rows(pools[current(WHERE).rank], p, *xs, done)
            return out if out is not None else torch.zeros(())
        out = shard_map(body, mesh=self.mesh, in_specs=(self.specs,) + (P(),) * 5, out_specs=P())(
            self.params, tokens, positions, tables, starts, lengths)
        return device_get(out) if done is not None else None

    def _rows(self, pool: KVPool, params, tokens, positions, tables, starts, lengths, done) -> torch.Tensor | None:
        if pool.device is None:
            pool.device = next(x.device for x in tree_util.leaves(params) if isinstance(x, torch.Tensor))
        dev = pool.device
        tokens, positions, tables, starts, lengths = (x.to(dev) for x in (tokens, positions, tables, starts, lengths))
        cache = PagedStep(pool, tables, starts, lengths, tokens.shape[1], self.impl, dense=tokens.shape[1] == 1)
        h = hook(self.model, "hidden")(params, tokens, positions=positions, cache=cache)  # (B, T, C)
        if done is None:
            return None
        idx = done.to(dev)
        last = h[idx, lengths[idx] - 1]  # (R, C)
        return whole_vocab(self.model, hook(self.model, "logits")(params, last[:, None])[:, 0])  # (R, V)


class _ProbeLayer:
    def __init__(self, shapes: dict, i: int):
        self.shapes, self.i = shapes, i

    def update(self, k: torch.Tensor, v: torch.Tensor, mask: Any) -> tuple:
        self.shapes[self.i] = (math.prod(k.shape[2:]) * k.element_size() + math.prod(v.shape[2:]) * v.element_size())
        return k, v, None


class _Probe:
    """A one-token cache recording each layer's bytes of keys and values per token."""

    validated = True

    def __init__(self, n: int):
        self.k, self.shapes = [None] * n, {}

    def layer(self, i: int) -> _ProbeLayer:
        return _ProbeLayer(self.shapes, i)

    def advance(self, n: int) -> None:
        del n


def _block_bytes(model: Any, params: Any, block_size: int, device: torch.device) -> int:
    """Bytes of one block of ``block_size`` tokens over every layer, from a one-token run."""
    probe = _Probe(len(model.blocks))
    one = torch.zeros(1, 1, dtype=torch.long, device=device)
    hook(model, "hidden")(params, one, positions=one, cache=probe)
    return sum(probe.shapes.values()) * block_size
