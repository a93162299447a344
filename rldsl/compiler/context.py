"""What a rule pass sees: one pipeline, its IR, the shared cluster, the
placement of every stage and the derived batch sizing."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import networkx as nx

from rldsl.compiler.decls import Decl, Pipeline, Program
from rldsl.compiler.ir import data_view


@dataclass(frozen=True)
class Sizing:
    """Batch and buffer sizes of a pipeline, explicit or derived."""

    train_stage: str
    prompts_per_step: int
    samples_per_prompt: int
    global_batch: int
    micro_batch: int
    max_lag: int
    capacity: int
    max_inflight: int


@dataclass
class Context:
    program: Program
    pipe: Pipeline
    graph: nx.MultiDiGraph
    placement: object = None  # rldsl.compiler.placement.Placement, once placed

    @property
    def cluster(self) -> Decl:
        return self.program.cluster

    @cached_property
    def data(self) -> nx.DiGraph:
        return data_view(self.graph)

    def upstream(self, node: str) -> set[str]:
        return nx.ancestors(self.data, node) if node in self.data else set()

    def train_stage(self) -> Decl | None:
        trains = self.pipe.stages_of("train")
        return trains[0] if len(trains) == 1 else None

    def generator_for(self, train: Decl) -> Decl | None:
        """The generate stage feeding a train stage (upstream in the data flow)."""
        ups = self.upstream(train.name)
        gens = [s for s in self.pipe.stages_of("generate") if s.name in ups]
        return gens[0] if gens else None

    def sizing(self) -> Sizing | None:
        train = self.train_stage()
        gen = train and self.generator_for(train)
        if train is None or gen is None:
            return None
        pps, spp = train["prompts_per_step"], gen["samples_per_prompt"]
        staleness, buffer = self.pipe.block("staleness"), self.pipe.block("buffer")
        max_lag = staleness["max_lag"]
        return Sizing(
            train_stage=train.name,
            prompts_per_step=pps,
            samples_per_prompt=spp,
            global_batch=train.get("global_batch", pps * spp),
            micro_batch=train.get("micro_batch", spp),
            max_lag=max_lag,
            capacity=buffer.get("capacity", pps * (max_lag + 1)),
            max_inflight=buffer.get("max_inflight", pps),
        )
