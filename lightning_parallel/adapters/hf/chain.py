"""What a Hugging Face decoder's ``forward`` does around its blocks, read from its source.

A pipeline runs the blocks the model's pipeline plan names, one after another; the base model's and the
causal LM's ``forward`` may do more between them: scale the embeddings (Granite's ``embedding_multiplier``,
AFMoE's muP ``hidden_size ** 0.5``), apply dropout to them (StarCoder2's ``embedding_dropout``), scale or
soft-cap the logits (Granite's ``logits_scaling``, Cohere's ``logit_scale``, Gemma 2/3's
``final_logit_softcapping``) or the hidden states before the head (MiniCPM3). :func:`read_chain` reads both
``forward`` functions with :mod:`ast` and returns these steps as :class:`Op` values the pipeline stages
apply where ``forward`` does -- with the values the model holds, and the guards (``if
self.config.final_logit_softcapping is not None``) evaluated on the model -- plus the keywords ``forward``
passes its decoder layers. A statement it does not recognise that changes the stream (a hyper-connection
head, a vocabulary slice, a per-layer scaling argument) is returned as unknown, so the model is refused
before any process starts, naming that statement.

Note:
    Reading the source is a prediction; the chain check (:mod:`lightning_parallel.parallel.pipeline.chain_check`)
    still runs the stages against ``forward`` on real weights before the split, so a step this reader misses
    cannot train silently wrong.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

#: Keywords a decoder layer may be given that the stages supply (or that only matter with a cache).
LAYER_KEYWORDS = frozenset({
    "attention_mask", "position_embeddings", "position_ids", "cache", "past_key_values", "past_key_value",
    "use_cache", "cache_position", "output_attentions", "layer_past",
})
_CASTS = {"float", "to", "contiguous"}
_PASS_THROUGH_CALLS = {"slice_logits_to_keep"}


@dataclass(frozen=True)
class Op:
    """One step ``forward`` applies to the stream between blocks.

    Attributes:
        kind: ``"mul"``, ``"div"``, ``"tanh"``, ``"float"`` (an upcast) or ``"dropout"``.
        value: the factor, divisor or dropout probability (as the model holds it).
        source: the statement it was read from, for messages.
    """

    kind: str
    value: float = 1.0
    source: str = ""

    def __call__(self, x: Tensor, training: bool) -> Tensor:
        if self.kind == "mul":
            return x * self.value
        if self.kind == "div":
            return x / self.value
        if self.kind == "tanh":
            return torch.tanh(x)
        if self.kind == "float":
            return x.float()
        return nn.functional.dropout(x, p=self.value, training=training)


@dataclass
class Chain:
    """What the forward functions do around the blocks (see :func:`read_chain`).

    Attributes:
        embed: steps after the embedding block.
        before_head: steps on the hidden states before the LM head.
        after_head: steps on the logits.
        layer_keywords: keywords the base model passes each decoder layer.
        masks: attention type -> the mask builder ``forward`` calls for it, where it names one per type
            (MiniMax's full-attention layers take a sliding-window mask when the config has a window).
        rope_types: the layer types given rotary positions (None: every type; NoPE layers get None).
        unknown: statements that change the stream and are not understood (source lines).
    """

    embed: list[Op] = field(default_factory=list)
    before_head: list[Op] = field(default_factory=list)
    after_head: list[Op] = field(default_factory=list)
    layer_keywords: set[str] = field(default_factory=set)
    rope_types: Optional[set[str]] = None
    masks: dict[str, Callable] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)


def _function(cls: type) -> tuple[Optional[ast.FunctionDef], dict[str, Any]]:
    """The ``forward`` of ``cls`` as a syntax tree, and the globals of its module (None when there is no source)."""
    forward = inspect.unwrap(cls.forward)
    try:
        source = textwrap.dedent(inspect.getsource(forward))
    except (OSError, TypeError):
        return None, {}
    node = ast.parse(source).body[0]
    found = node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    return found, dict(getattr(forward, "__globals__", {}))


def _self_expression(node: ast.AST, known: frozenset[str] = frozenset()) -> bool:
    """Whether ``node`` reads only ``self`` (its attributes and config), ``known`` names and constants."""
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    return bool(names) and names <= {"self", *known} and not any(isinstance(n, ast.Call) for n in ast.walk(node))


def _plain(node: ast.AST) -> bool:
    """A block's argument that is a variable or a slice of one (no computation inside the call)."""
    if isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Name)


class _Reader:
    """Walks one ``forward``'s statements, collecting steps on the tracked names into a :class:`Chain`."""

    def __init__(self, function: ast.FunctionDef, owner: nn.Module, blocks: set[str], chain: Chain,
                 place: Callable[[], Optional[list[Op]]], module_globals: Optional[dict[str, Any]] = None) -> None:
        self.owner, self.blocks, self.chain, self.place = owner, blocks, chain, place
        self.globals = module_globals or {}
        self.tracked = {"inputs_embeds", "hidden_states", "logits"}
        params = [a.arg for a in function.args.args + function.args.kwonlyargs]
        self.namespace: dict[str, Any] = {name: None for name in params}
        self.namespace.update({"self": owner, "input_ids": object(), "torch": torch})
        self.seen: set[str] = set()
        self.loop_done = False

    def evaluate(self, node: ast.AST) -> Any:
        return eval(compile(ast.Expression(node), "<forward>", "eval"), self.globals, dict(self.namespace))  # noqa: S307

    def value(self, node: ast.AST) -> Optional[float]:
        try:
            return float(self.evaluate(node))
        except Exception:  # noqa: BLE001 -- anything that does not evaluate to a number is not a scalar step
            return None

    def read(self, statements: list[ast.stmt]) -> None:
        for statement in statements:
            if isinstance(statement, ast.If):
                self._branch(statement)
            elif isinstance(statement, (ast.For, ast.While)):
                self._loop(statement)
            elif isinstance(statement, (ast.With, ast.Try)):
                self.read(statement.body)
            elif isinstance(statement, ast.Assign) and len(statement.targets) == 1:
                self._assign(statement, statement.targets[0], statement.value)
            elif isinstance(statement, ast.AugAssign):
                binary = ast.BinOp(left=statement.target, op=statement.op, right=statement.value)
                self._assign(statement, statement.target, binary)
            elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
                self._assign(statement, statement.target, statement.value)

    def _touches(self, node: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and n.id in self.tracked and isinstance(n.ctx, ast.Store)
                   for n in ast.walk(node))

    def _branch(self, statement: ast.If) -> None:
        try:
            verdict = bool(self.evaluate(statement.test))
        except Exception:  # noqa: BLE001 -- a guard on local state: unknown if it touches the stream
            if self._touches(statement):
                self.chain.unknown.append(ast.unparse(statement).splitlines()[0])
            return
        self.read(statement.body if verdict else statement.orelse)

    def _loop(self, statement: ast.stmt) -> None:
        over = ast.unparse(getattr(statement, "iter", statement))
        if not any(f"self.{block}" in over for block in self.blocks):
            if self._touches(statement):
                self.chain.unknown.append(ast.unparse(statement).splitlines()[0])
            return
        for node in ast.walk(statement):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                self.chain.layer_keywords |= {k.arg for k in node.keywords if k.arg is not None}
                rope = next((k.value for k in node.keywords if k.arg == "position_embeddings"), None)
                if isinstance(rope, ast.IfExp):
                    self._rope_types(rope)
        self.loop_done = True

    def _rope_types(self, choice: ast.IfExp) -> None:
        """The layer types ``position_embeddings=... if layer_type == ... else None`` gives positions (NoPE)."""
        kinds = set(getattr(self.owner.config, "layer_types", None) or [])
        try:
            given = {kind for kind in kinds
                     if eval(compile(ast.Expression(choice), "<forward>", "eval"), {},  # noqa: S307
                             {**self.namespace, "layer_type": kind, "position_embeddings": True}) is not None}
        except Exception:  # noqa: BLE001
            self.chain.unknown.append(f"position_embeddings={ast.unparse(choice)}")
            return
        self.chain.rope_types = given

    def _assign(self, statement: ast.stmt, target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, ast.Name) and target.id not in self.tracked:
            self.namespace.pop(target.id, None)
            self._masks(value)
            # A local the guards may read (``softcap = self.config.final_...``, ``mask_function = (... if ...)``).
            if _self_expression(value, frozenset(self.globals) | frozenset(self.namespace)):
                try:
                    self.namespace[target.id] = self.evaluate(value)
                except Exception:  # noqa: BLE001, S110 -- left undefined: a guard reading it is unknown
                    pass
            return
        if not (isinstance(target, ast.Name) and target.id in self.tracked):
            return
        if self._structural(value):
            return
        ops = self._ops(target.id, value)
        where = self.place()
        if ops is None or where is None:
            self.chain.unknown.append(ast.unparse(statement))
        else:
            where.extend(Op(kind, number, ast.unparse(statement)) for kind, number in ops)

    def _masks(self, value: ast.AST) -> None:
        """``{"full_attention": create_causal_mask(...), ...}``: the builder ``forward`` calls per attention type."""
        if not isinstance(value, ast.Dict):
            return
        for key, call in zip(value.keys, value.values):
            if (isinstance(key, ast.Constant) and isinstance(key.value, str) and isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Name)):
                builder = self.namespace.get(call.func.id, self.globals.get(call.func.id))
                if callable(builder):
                    self.chain.masks[key.value] = builder

    def _structural(self, value: ast.AST) -> bool:
        """A block call, an alias, the base model's output, or a pass-through helper."""
        if isinstance(value, ast.Name):
            return value.id in self.tracked
        if isinstance(value, (ast.Attribute, ast.Subscript)) and "outputs" in ast.unparse(value):
            return True
        if isinstance(value, ast.Call):
            func = value.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
                if func.attr in self.blocks and all(_plain(arg) for arg in value.args):
                    self.seen.add(func.attr)
                    return True
            return isinstance(func, ast.Name) and func.id in _PASS_THROUGH_CALLS
        return False

    def _stream(self, node: ast.AST, name: str) -> Optional[list[tuple[str, float]]]:
        """The steps that make ``node`` from the stream ``name`` (itself, an upcast of it, or the head's call)."""
        if isinstance(node, ast.Name) and node.id == name:
            return []
        if isinstance(node, (ast.Attribute, ast.Subscript)) and ast.unparse(node).startswith("outputs"):
            return []  # the base model's output, as the head's stream starts
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in _CASTS and isinstance(node.func.value, ast.Name) and node.func.value.id == name:
                return [("float", 1.0)] if node.func.attr == "float" else []
            if ast.unparse(node.func.value) == "self" and node.func.attr in self.blocks and all(map(_plain, node.args)):
                self.seen.add(node.func.attr)
                return []
        return None

    def _ops(self, name: str, value: ast.AST) -> Optional[list[tuple[str, float]]]:
        cast = self._stream(value, name)
        if cast is not None:
            return cast
        if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Mult, ast.Div)):
            kind = "mul" if isinstance(value.op, ast.Mult) else "div"
            pairs = [(value.left, value.right)] + ([(value.right, value.left)] if kind == "mul" else [])
            for stream, scalar in pairs:
                before = self._stream(stream, name)
                number = self.value(scalar) if _self_expression(scalar) else None
                if before is not None and number is not None:
                    return before + [(kind, number)]
            return None
        if isinstance(value, ast.Call) and value.args and ast.unparse(value.func) == "torch.tanh":
            return None if self._stream(value.args[0], name) is None else [("tanh", 1.0)]
        if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("functional.dropout") and value.args:
            probability = next((k.value for k in value.keywords if k.arg == "p"), None)
            number = self.value(probability) if probability is not None else None
            if self._stream(value.args[0], name) is not None and number is not None:
                return [("dropout", number)]
        return None


def read_chain(model: nn.Module, base_blocks: set[str], embed: str, head_blocks: set[str]) -> Chain:
    """Read the causal LM's and its base model's ``forward`` (see the module docstring).

    Args:
        model: the causal LM.
        base_blocks: the base model's pipeline blocks (attribute names, the decoder list included).
        embed: the embedding block's name (steps on the stream after it are the embedding's).
        head_blocks: the causal LM's head blocks (``lm_head``).
    """
    chain = Chain()
    base = model.base_model
    function, module_globals = _function(type(base))
    if function is not None:
        reader = _Reader(function, base, base_blocks, chain, lambda: None, module_globals)
        reader.place = lambda: None if reader.loop_done or embed not in reader.seen else chain.embed
        reader.read(function.body)
    function, module_globals = _function(type(model))
    if function is not None:
        reader = _Reader(function, model, head_blocks, chain, lambda: None, module_globals)
        reader.place = lambda: chain.after_head if head_blocks & reader.seen else chain.before_head
        reader.read(function.body)
    return chain


def apply_ops(ops: list[Op], x: Tensor, training: bool) -> Tensor:
    """``x`` through ``ops`` in order."""
    for op in ops:
        x = op(x, training)
    return x
