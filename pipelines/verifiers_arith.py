"""A verifiers taskset (verifiers 0.4's API, nothing of rldsl's): arithmetic.

Each task asks one sum, such as ``"12+19="``, and scores the reply by exact
match; written as verifiers' own `vf-init` scaffold writes a taskset (a
``Taskset`` exported in ``__all__``, a ``Task`` with ``@vf.reward``).
`pipelines/verifiers_arith.rlp` trains on it.
"""

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str
    """The sum, as digits."""


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def exact_match(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumConfig(vf.TasksetConfig):
    largest: int = 99
    """The largest operand."""


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        numbers = range(self.config.largest + 1)
        return [SumTask(SumData(id=f"{a}+{b}", prompt=f"{a}+{b}=", answer=str(a + b)), self.config.task)
                for a in numbers for b in numbers]


__all__ = ["SumTaskset"]
