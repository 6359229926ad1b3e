"""Models, batches and the unsharded reference shared by the tests."""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fsdp_fn as ff
from examples.gpt import GPT, Block, GPTConfig, lm_loss


class MLP(nn.Module):
    """Layer widths that divide by no world size, so shards need padding."""

    def __init__(self, widths: tuple[int, ...] = (7, 13, 5, 3), act: type[nn.Module] = nn.Tanh) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), act()]
        self.net = nn.Sequential(*layers[:-1])

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.net(x) * scale


class Permute(nn.Module):
    """``x[..., perm]``: a module whose one parameter is a frozen int64 permutation of 5."""

    def __init__(self) -> None:
        super().__init__()
        self.perm = nn.Parameter(torch.tensor([3, 0, 4, 1, 2]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., self.perm]


class Permuted(nn.Module):
    """A linear layer whose outputs are permuted by a frozen int64 parameter (``x[..., perm]``) and
    scaled by a frozen float one: a unit with a trainable part and two frozen parts."""

    def __init__(self, d: int = 5) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.perm = nn.Parameter(torch.randperm(d), requires_grad=False)  # 5 elements: no W of 2 or 3 divides it
        self.scale = nn.Parameter(torch.rand(d) + 0.5, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[..., self.perm] * self.scale


class IntegerParams(nn.Module):
    """Two ``Permuted`` blocks, a head, and at the root a frozen int32 parameter read by
    ``torch.index_select`` and a frozen bool one read by ``torch.where`` (the root's frozen
    parts: int32 and bool)."""

    def __init__(self, d: int = 5, out: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Permuted(d) for _ in range(2)])
        self.head = nn.Linear(d, out)
        self.pick = nn.Parameter(torch.tensor([2, 0, 1], dtype=torch.int32), requires_grad=False)
        self.keep = nn.Parameter(torch.tensor([True, False, True]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        y = torch.index_select(self.head(x), -1, self.pick)
        return torch.where(self.keep, y, 0.5 * y)


def mse_loss(model: Callable[..., Any], batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def make(kind: str, seed: int = 0, **kw: Any) -> tuple[nn.Module, ff.Policy, Callable[..., Any]]:
    """(model, policy, loss_fn) for a named test model, initialised from ``seed``."""
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP(**kw), ff.layer_policy([nn.Linear]), mse_loss
    if kind == "int":
        return IntegerParams(**kw), ff.layer_policy([Permuted]), mse_loss
    if kind == "gpt":
        cfg = GPTConfig(**{"vocab": 37, "seq": 9, "d_model": 12, "n_layers": 3, "n_heads": 2, **kw})
        return GPT(cfg), ff.layer_policy([Block]), lm_loss
    raise ValueError(kind)


@contextlib.contextmanager
def rows_fetched() -> Iterator[None]:
    """Lookups fetch their rows whatever their table's size (the tests' tables are small; a train
    step gathers a table under ``fsdp_fn._lookup.ROWS_MIN_BYTES``)."""
    from fsdp_fn import _lookup

    before, _lookup.ROWS_MIN_BYTES = _lookup.ROWS_MIN_BYTES, 0
    try:
        yield
    finally:
        _lookup.ROWS_MIN_BYTES = before


def gpt_state(group, cfg: GPTConfig, *, split_root: bool = False, **schedule: Any):
    """(plan, step, state) for a GPT with one unit per block, trained with AdamW on ``group``
    on the ``Schedule`` with these fields."""
    torch.manual_seed(0)
    model = GPT(cfg)
    fn = ff.functionalize(model)
    plan = ff.make_plan(model, ff.layer_policy([Block]), split_root=split_root)
    step = ff.train_step(fn, lm_loss, ff.adamw(), schedule=ff.Schedule(**schedule))
    return plan, step, step.init(ff.shard(fn.params, plan, group))


def batch_for(kind: str, model: nn.Module, step: int, size: int = 12) -> Any:
    # (the integer model sees one batch every step: it fits it, so its loss drops within a few steps)
    g = torch.Generator().manual_seed(1000 + (step if kind != "int" else 0))
    if kind in ("mlp", "int"):
        widths = [m.in_features for m in model.modules() if isinstance(m, nn.Linear)]
        outs = [m.out_features for m in model.modules() if isinstance(m, nn.Linear)]
        return torch.randn(size, widths[0], generator=g), torch.randn(size, outs[-1], generator=g)
    cfg = model.cfg
    return torch.randint(0, cfg.vocab, (size, cfg.seq + 1), generator=g)


def local_part(batch: Any, rank: int, world: int) -> Any:
    if isinstance(batch, tuple):
        return tuple(local_part(b, rank, world) for b in batch)
    return batch.chunk(world)[rank]


def reference_run(
    model: nn.Module,
    loss_fn: Callable[..., Any],
    batches: list[Any],
    make_opt: Callable[..., Any],
    *,
    clip: float | None = None,
    param_dtype: torch.dtype | None = None,
    after_step: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Unsharded training in this process: losses, gradient norms and final parameters.

    Only parameters that require grad are optimized. ``clip``: torch's clip_grad_norm_.
    ``param_dtype``: the forward and backward run on a copy of the parameters cast to it
    (inputs cast too, output back to float32), gradients cast back, as fsdp_fn's mixed
    precision does. ``after_step``: called after each optimizer step (a learning-rate scheduler's).
    """
    model = copy.deepcopy(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = make_opt(trainable)
    losses, norms = [], []
    for b in batches:
        opt.zero_grad()
        if param_dtype is None:
            loss = loss_fn(model, b)
            loss.backward()
        else:
            low = {  # (an integer or bool parameter is never cast, as fsdp_fn's mixed precision leaves it)
                k: (v.detach().to(param_dtype) if v.is_floating_point() else v.detach()).requires_grad_(v.requires_grad)
                for k, v in model.named_parameters()
            }

            def run(*args, low=low, **kwargs):
                args = [a.to(param_dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
                return torch.func.functional_call(model, low, tuple(args), kwargs).float()

            loss = loss_fn(run, b)
            loss.backward()
            for k, p in model.named_parameters():
                if p.requires_grad:
                    p.grad = low[k].grad.float()
        norms.append(torch.sqrt(sum(p.grad.double().square().sum() for p in trainable)).item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(trainable, clip)
        losses.append(loss.item())
        opt.step()
        if after_step is not None:
            after_step()
    return {"losses": losses, "norms": norms, "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@contextlib.contextmanager
def _uses_where(method: str, when: Callable[[Any], bool]) -> Iterator[list[str]]:
    """Within the block, the names of the units whose ``GatheredUnit.<method>`` ran while
    ``when(use)`` held, in order."""
    from fsdp_fn import _unit

    names: list[str] = []
    original = getattr(_unit.GatheredUnit, method)

    def patched(self: _unit.GatheredUnit) -> None:
        if when(self):
            names.append(self.unit.name)
        original(self)

    setattr(_unit.GatheredUnit, method, patched)
    try:
        yield names
    finally:
        setattr(_unit.GatheredUnit, method, original)


def released_in_backward() -> contextlib.AbstractContextManager[list[str]]:
    """Within the block, the units whose gathered buffer was dropped inside a backward (not
    after it): their names, in order."""
    from fsdp_fn._unit import UnitState

    return _uses_where(
        "release", lambda use: torch._C._current_graph_task_id() != -1 and use.state is UnitState.GATHERED
    )


def refills_on_demand() -> contextlib.AbstractContextManager[list[str]]:
    """Within the block, the units whose backward had to start its own refill (it was not
    prefetched): their names, in the order their backward ran."""
    from fsdp_fn._unit import UnitState

    return _uses_where("pre_backward", lambda use: use.state is UnitState.FREED)


def tiny_llama(seed: int = 0, **config: Any) -> nn.Module:
    """A Hugging Face ``LlamaForCausalLM`` built from a small config (``config`` overrides it);
    transformers is pinned in requirements-dev.txt and downloads nothing here."""
    import transformers

    defaults = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
    }
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**(defaults | config)))


def tiny_hugging_face(
    name: str, seed: int = 0
) -> tuple[nn.Module, type, Callable[[Any, Any], torch.Tensor], list[Any]]:
    """A small Hugging Face model of another family than Llama: (model, its layer class, a
    loss, three global batches of 6). ``gpt2``: Conv1D layers, the head tied to the token
    embedding; ``bert``: an encoder with a pooler and a classifier; ``t5``: an encoder and a
    decoder, a shared embedding, a learned position bias; ``qwen2``: grouped-query attention,
    tied head. Dropout off (the reference draws other masks), the cache off (what training
    with remat needs)."""
    import transformers as hf

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if name == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block as layer

        model = hf.GPT2LMHeadModel(
            hf.GPT2Config(
                vocab_size=61, n_positions=32, n_embd=24, n_layer=3, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
            )
        )
        batches = [torch.randint(0, 61, (6, 10), generator=g) for _ in range(3)]
        return model, layer, lambda m, b: m(input_ids=b, labels=b, use_cache=False).loss, batches
    if name == "bert":
        from transformers.models.bert.modeling_bert import BertLayer as layer

        model = hf.BertForSequenceClassification(
            hf.BertConfig(
                vocab_size=61,
                hidden_size=24,
                num_hidden_layers=3,
                num_attention_heads=2,
                intermediate_size=37,
                max_position_embeddings=32,
                hidden_dropout_prob=0,
                attention_probs_dropout_prob=0,
                num_labels=3,
            )
        )
        batches = [
            (torch.randint(0, 61, (6, 10), generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(3)
        ]
        return model, layer, lambda m, b: m(input_ids=b[0], labels=b[1]).loss, batches
    if name == "t5":
        from transformers.models.t5.modeling_t5 import T5Block as layer

        model = hf.T5ForConditionalGeneration(
            hf.T5Config(
                vocab_size=61,
                d_model=24,
                d_kv=8,
                d_ff=37,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=3,
                dropout_rate=0,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
        )
        batches = [
            (torch.randint(1, 61, (6, 10), generator=g), torch.randint(1, 61, (6, 7), generator=g)) for _ in range(3)
        ]
        return model, layer, lambda m, b: m(input_ids=b[0], labels=b[1], use_cache=False).loss, batches
    if name == "qwen2":
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer as layer

        model = hf.Qwen2ForCausalLM(
            hf.Qwen2Config(
                vocab_size=61,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=32,
                tie_word_embeddings=True,
            )
        )
        batches = [torch.randint(0, 61, (6, 10), generator=g) for _ in range(3)]
        return model, layer, lambda m, b: m(input_ids=b, labels=b, use_cache=False).loss, batches
    raise ValueError(f"no tiny {name!r}")


@contextlib.contextmanager
def collectives(value: str | None) -> Iterator[None]:
    """``FSDP_FN_COLLECTIVES=value`` (``""``: the default choice; ``None``: as it is), each
    group's comm chosen again, then as before."""
    from fsdp_fn import _collectives

    before = os.environ.get("FSDP_FN_COLLECTIVES")
    if value is not None:
        os.environ["FSDP_FN_COLLECTIVES"] = value
        _collectives.choose_again()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("FSDP_FN_COLLECTIVES", None)
        else:
            os.environ["FSDP_FN_COLLECTIVES"] = before
        _collectives.choose_again()


def native_collectives(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """The backend's own all-gather and reduce-scatter instead of the pairwise exchanges (gloo has
    both): ``FSDP_FN_COLLECTIVES=native`` (``collectives``)."""
    return collectives("native" if on else None)
