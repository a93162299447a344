"""Settings the language renamed: an old spelling keeps working, with a
warning (RLP109) naming the new one and an edit `rldsl fmt --fix` applies.

A file written before a rename must still check, plan and run as it did:
refusing the old spelling would also hide every finding that reads the
setting (a loss left unresolved leaves its train stage's rules skipped).
"""

from __future__ import annotations

from typing import NamedTuple


class RenamedArgument(NamedTuple):
    new: str  # the argument's name now
    values: dict[str, str]  # each old value -> the same meaning under the new name


# (call kind, callee, old argument) -> the rename
RENAMED_ARGUMENTS: dict[tuple[str, str, str], RenamedArgument] = {
    # `agg` (token_mean, seq_mean_token_sum, seq_mean_token_mean) replaced `level` (token, sequence)
    ("loss", "grpo", "level"): RenamedArgument("agg", {"token": "token_mean", "sequence": "seq_mean_token_mean"}),
}


def renamed_argument(what: str, callee: str, argument: str) -> RenamedArgument | None:
    return RENAMED_ARGUMENTS.get((what, callee, argument))
