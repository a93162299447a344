"""Resolved pipeline -> IR: a networkx graph of sources and stages.

Data edges come from `flow` and carry the fields their source produces;
weight edges come from `sync` stages and close the RL loop. Only data edges
take part in the cycle check.
"""

from __future__ import annotations

import networkx as nx

from rldsl.compiler.decls import Decl, Pipeline
from rldsl.plan import EPISODE_REWARD_FN, truncates_long_prompts

DATA = "data"
WEIGHTS = "weights"

# What each node kind writes to the data plane (see rldsl.runtime.protocols).
_GENERATED = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "version")
# ... and by a generate stage with an environment: which tokens are the model's, and each episode's outcome
EPISODE_FIELDS = ("loss_mask", "episode_reward", "episode_status", "turns", "tool_calls", "tool_errors", "turn_rewards",
                  "context_full")


def produced_fields(kind: str, decl: Decl | None, masks_prompts: bool = False) -> tuple[str, ...]:
    """``masks_prompts``: the dataset truncates long prompts, whose samples a loss mask leaves out."""
    if kind == "dataset":
        return ("prompt", "answer")
    if kind == "generate":
        masked = decl.get("truncated") == "mask" or masks_prompts
        return _GENERATED + (("behaviour_logprobs",) if decl.get("logprobs") else ()) + \
            (EPISODE_FIELDS if decl.get("environment") else ("loss_mask",) if masked else ())
    if kind == "reward":
        return ("reward",)
    if kind == "logprob":
        return ("ref_logprobs",) if decl.get("frozen") else ("behaviour_logprobs",)
    return ()


def consumed_fields(kind: str, decl: Decl | None, max_lag: int) -> dict[str, str]:
    """field -> why it is needed (for the diagnostic)."""
    if kind == "generate":
        return {"prompt": "generation starts from prompts"}
    if kind in ("reward",):
        if decl is not None and decl.get("fn") == EPISODE_REWARD_FN:
            return {"episode_reward": f"`{EPISODE_REWARD_FN}` reads the reward of an environment's episode"}
        return {"response_ids": "rewards score responses", "answer": "rewards compare against the answer"}
    if kind == "logprob":
        return {"response_ids": "logprobs are computed over responses"}
    if kind == "train":
        need = {"response_ids": "training needs responses", "reward": "GRPO advantages are computed from rewards"}
        loss = decl.get("loss")
        if loss is not None and loss.args.get("kl", 0) > 0:
            need["ref_logprobs"] = f"the KL term (kl = {loss.args['kl']:g}) needs reference logprobs"
        if max_lag > 0:
            need["behaviour_logprobs"] = (f"max_lag = {max_lag} trains off-policy samples: the importance ratio "
                                          "needs behaviour logprobs")
        weighting = token_weighting(loss)
        if weighting:
            need["behaviour_logprobs"] = f"{weighting} weighs each token by pi_prox / pi_behaviour"
        return need
    return {}


def token_weighting(loss) -> str:
    """The loss argument that weighs tokens by the behaviour policy (``correction = tis``), or ''."""
    args = loss.args if loss is not None else {}
    if args.get("correction", "none") != "none":
        return f"correction = {args['correction']}"
    return f"behaviour_cap = {args['behaviour_cap']:g}" if args.get("behaviour_cap") else ""


def build_ir(pipe: Pipeline) -> nx.MultiDiGraph:
    graph = nx.MultiDiGraph(name=pipe.name)
    for name, decl in pipe.datasets.items():
        graph.add_node(name, kind="dataset", decl=decl)
    for name, decl in pipe.stages.items():
        if decl.stage_kind != "sync":
            graph.add_node(name, kind=decl.stage_kind, decl=decl)
    for edge in pipe.edges:
        if edge.src in graph and edge.dst in graph:
            src = graph.nodes[edge.src]
            graph.add_edge(edge.src, edge.dst, key=DATA, kind=DATA, span=edge.dst_span, src_span=edge.src_span,
                           fields=produced_fields(src["kind"], src["decl"], _masks_prompts(pipe)))
    for sync in pipe.stages_of("sync"):
        source = sync.get("from")
        for target in sync.get("to") or ():
            if source and source.name in graph and target.name in graph:
                graph.add_edge(source.name, target.name, key=WEIGHTS, kind=WEIGHTS, sync=sync.name, span=target.span)
    return graph


def _masks_prompts(pipe: Pipeline) -> bool:
    return any(truncates_long_prompts({key: d.get(key) for key in ("max_prompt_tokens", "long_prompts")})
               for d in pipe.datasets.values() if d.valid("max_prompt_tokens", "long_prompts"))


def data_view(graph: nx.MultiDiGraph) -> nx.DiGraph:
    """The data edges only, as a simple digraph (cycle check, generations)."""
    view = nx.DiGraph()
    view.add_nodes_from(graph.nodes(data=True))
    view.add_edges_from((u, v, d) for u, v, d in graph.edges(data=True) if d["kind"] == DATA)
    return view


def generations(graph: nx.MultiDiGraph) -> list[list[str]]:
    """The dataflow in topological generations (empty when there is a cycle)."""
    view = data_view(graph)
    if not nx.is_directed_acyclic_graph(view):
        return []
    return [sorted(g) for g in nx.topological_generations(view)]
