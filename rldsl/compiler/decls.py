"""Resolved declarations: typed settings with their spans, names bound."""


from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rldsl.compiler.diagnostics import Span


class Setting(NamedTuple):
    value: Any
    span: Span | None  # None for a default nobody wrote
    explicit: bool
    item_spans: tuple[Span, ...] = ()  # each item's span, for a list written in the file


@dataclass
class Decl:
    """A block after resolution: `stage train actor { ... }` and the like."""

    kind: str  # cluster, model, dataset, stage, staleness, buffer, placement, run
    name: str  # the declared name, or the kind for unnamed blocks
    span: Span
    name_span: Span
    settings: dict[str, Setting] = field(default_factory=dict)
    stage_kind: str | None = None  # generate, reward, logprob, train, sync
    # Keys written wrongly, set twice, required but missing, or naming nothing:
    # they hold no value (never a default), and a rule reading one is skipped.
    invalid: set[str] = field(default_factory=set)

    def __getitem__(self, key: str) -> Any:
        return self.settings[key].value

    def get(self, key: str, default: Any = None) -> Any:
        setting = self.settings.get(key)
        return default if setting is None or setting.value is None else setting.value

    def span_of(self, key: str) -> Span:
        setting = self.settings.get(key)
        return setting.span if setting is not None and setting.span is not None else self.name_span

    def explicit(self, key: str) -> bool:
        setting = self.settings.get(key)
        return bool(setting and setting.explicit)

    def valid(self, *keys: str) -> bool:
        """Whether every one of ``keys`` resolved (to a written value or a default)."""
        return not self.invalid.intersection(keys)

    @property
    def engine_name(self) -> str | None:
        """A stage's engine by name, when its `engine` resolved (None otherwise, or without one)."""
        engine = self.get("engine") if self.valid("engine") else None
        return engine.name if engine is not None else None

    def item_span(self, key: str, index: int) -> Span:
        setting = self.settings.get(key)
        if setting is not None and index < len(setting.item_spans):
            return setting.item_spans[index]
        return self.span_of(key)


class FlowEdge(NamedTuple):
    src: str
    dst: str
    src_span: Span
    dst_span: Span


@dataclass
class Pipeline:
    name: str
    span: Span
    name_span: Span
    models: dict[str, Decl] = field(default_factory=dict)
    datasets: dict[str, Decl] = field(default_factory=dict)
    environments: dict[str, Decl] = field(default_factory=dict)  # multi-turn environments of generate stages
    stages: dict[str, Decl] = field(default_factory=dict)
    blocks: dict[str, Decl] = field(default_factory=dict)  # staleness, buffer, placement, run
    edges: list[FlowEdge] = field(default_factory=list)
    # Names declared twice: which declaration was meant is unknown, so rules
    # skip both and a reference to one is invalid.
    ambiguous: set[str] = field(default_factory=set)
    # False when a declaration was dropped (an unknown stage kind, a malformed
    # head): what the pipeline holds is then unknown.
    complete: bool = True
    flows_valid: bool = True  # every name in every flow resolved
    qualified: bool = False  # the file has several pipelines: messages name this one

    @property
    def where(self) -> str:
        """A suffix naming the pipeline, for messages in a file with several pipelines."""
        return f" in pipeline `{self.name}`" if self.qualified else ""

    def stages_of(self, kind: str) -> list[Decl]:
        return [s for s in self.stages.values() if s.stage_kind == kind]

    def model_of(self, stage: Decl) -> Decl | None:
        """The model declaration a stage names, when its `model` resolved."""
        ref = stage.get("model") if stage.valid("model") else None
        return self.models.get(ref.name) if ref is not None else None

    def block(self, kind: str) -> Decl:
        return self.blocks[kind]

    @property
    def declarations_known(self) -> bool:
        """The pipeline holds exactly what was written: no declaration dropped or ambiguous."""
        return self.complete and not self.ambiguous

    @property
    def dataflow_known(self) -> bool:
        """The data graph is the one written: declarations known, every flow name resolved."""
        return self.declarations_known and self.flows_valid


@dataclass
class Program:
    cluster: Decl  # its keys are all invalid when the file has no cluster, or two
    pipelines: list[Pipeline]
    filename: str = "<input>"
    # Every pipeline name written, those declared twice too (their pipelines
    # are left out of `pipelines`: which one a rule should see is unknown).
    pipeline_names: tuple[str, ...] = ()
    ambiguous_pipelines: frozenset[str] = frozenset()

    @property
    def multi(self) -> bool:
        return len(self.pipeline_names) > 1

    def label(self, pipeline: str, stage: str) -> str:
        """A stage as messages name it: `a/rollout` when the file has several pipelines."""
        return f"`{pipeline}/{stage}`" if self.multi else f"`{stage}`"

    def pipeline(self, name: str) -> Pipeline:
        return next(p for p in self.pipelines if p.name == name)
