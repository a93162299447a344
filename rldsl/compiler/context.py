"""What a rule pass sees: one pipeline, its IR, the shared cluster, the
placement of every stage and the derived batch sizing.

The helpers answer None when their inputs did not resolve, so a rule that
uses one is skipped rather than given a stand-in value."""

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
    ppo_epochs: int = 1


@dataclass
class Context:
    program: Program
    pipe: Pipeline
    graph: nx.MultiDiGraph
    placement: object = None  # rldsl.compiler.placement.Placement, once placed (None: the cluster is unknown)

    @property
    def cluster(self) -> Decl:
        return self.program.cluster

    def label(self, stage: str) -> str:
        """`rollout`, or `a/rollout` in a file with several pipelines."""
        return self.program.label(self.pipe.name, stage)

    @cached_property
    def data(self) -> nx.DiGraph:
        return data_view(self.graph)

    def upstream(self, node: str) -> set[str]:
        return nx.ancestors(self.data, node) if node in self.data else set()

    def train_stage(self) -> Decl | None:
        trains = self.pipe.stages_of("train")
        return trains[0] if len(trains) == 1 else None

    def generator_for(self, train: Decl) -> Decl | None:
        """The generate stage feeding a train stage (the first by name if
        several do); None when the data graph is not the one written."""
        if not self.pipe.dataflow_known:
            return None
        ups = self.upstream(train.name)
        gens = sorted((s for s in self.pipe.stages_of("generate") if s.name in ups), key=lambda s: s.name)
        return gens[0] if gens else None

    def lag(self) -> int | None:
        staleness = self.pipe.block("staleness")
        return staleness["max_lag"] if staleness.valid("max_lag") else None

    def step_shape(self) -> tuple[Decl, Decl] | None:
        """(train, generator) when one step's batch is known: the sizes RLP301-303 read."""
        train = self.train_stage()
        gen = train and self.generator_for(train)
        if gen is None or not train.valid("prompts_per_step", "global_batch", "micro_batch") \
                or not gen.valid("samples_per_prompt"):
            return None
        return train, gen

    def buffer_shape(self) -> tuple[int, int, int, int] | None:
        """(prompts_per_step, max_lag, capacity, max_inflight), the numbers RLP304-306 read."""
        train, buffer, lag = self.train_stage(), self.pipe.block("buffer"), self.lag()
        if train is None or lag is None or not train.valid("prompts_per_step") \
                or not buffer.valid("capacity", "max_inflight"):
            return None
        pps = train["prompts_per_step"]
        return pps, lag, buffer.get("capacity", pps * (lag + 1)), buffer.get("max_inflight", pps)

    def sizing(self) -> Sizing | None:
        shape, buffer = self.step_shape(), self.buffer_shape()
        if shape is None or buffer is None:
            return None
        train, gen = shape
        pps, spp = train["prompts_per_step"], gen["samples_per_prompt"]
        _, max_lag, capacity, max_inflight = buffer
        return Sizing(
            train_stage=train.name,
            prompts_per_step=pps,
            samples_per_prompt=spp,
            global_batch=train.get("global_batch", pps * spp),
            micro_batch=train.get("micro_batch", spp),
            max_lag=max_lag,
            capacity=capacity,
            max_inflight=max_inflight,
            ppo_epochs=train.get("ppo_epochs", 1),
        )
