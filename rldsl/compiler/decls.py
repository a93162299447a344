"""Resolved declarations: typed settings with their spans, names bound."""


from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rldsl.compiler.diagnostics import Span


class Setting(NamedTuple):
    value: Any
    span: Span | None  # None for a default nobody wrote
    explicit: bool


@dataclass
class Decl:
    """A block after resolution: `stage train actor { ... }` and the like."""

    kind: str  # cluster, model, dataset, stage, staleness, buffer, placement, run
    name: str  # the declared name, or the kind for unnamed blocks
    span: Span
    name_span: Span
    settings: dict[str, Setting] = field(default_factory=dict)
    stage_kind: str | None = None  # generate, reward, logprob, train, sync

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
    stages: dict[str, Decl] = field(default_factory=dict)
    blocks: dict[str, Decl] = field(default_factory=dict)  # staleness, buffer, placement, run
    edges: list[FlowEdge] = field(default_factory=list)

    def stages_of(self, kind: str) -> list[Decl]:
        return [s for s in self.stages.values() if s.stage_kind == kind]

    def block(self, kind: str) -> Decl:
        return self.blocks[kind]


@dataclass
class Program:
    cluster: Decl
    pipelines: list[Pipeline]
    filename: str = "<input>"
