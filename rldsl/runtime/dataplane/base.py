"""The data-plane contract every backend implements: sample keys, the
``DataPlane`` interface, ``MissingDataError``, and the argument checks and
row padding the backends share so that they behave identically.

Semantics, identical on every backend:
- ``put`` takes dense tensors, row i belonging to ``keys[i]``, and stores each
  row per key. Writing a field again replaces it; tags merge.
- ``get`` returns dense tensors, rows in the order of ``keys``. Rows of one
  field may differ in length (e.g. from puts padded to different widths):
  they are padded with 0 to the longest requested row, on the left for
  ``left_padded_fields`` (the prompt fields by default, so prompts stay
  aligned against their responses), else on the right. TransferQueue returns
  every non-scalar field as a jagged nested tensor even when it was put
  dense; its ``get`` converts it back (``dataplane_transferqueue``).
- A missing key or field raises ``MissingDataError`` (TransferQueue itself
  silently drops missing keys and returns an empty batch for missing fields).
"""

from __future__ import annotations

import abc
from typing import Any, Iterable, Mapping, Sequence

from rldsl.runtime.protocols import (
    FIELD_BEHAVIOUR_LOGPROBS,
    FIELD_PROMPT_IDS,
    FIELD_PROMPT_MASK,
    FIELD_REF_LOGPROBS,
    FIELD_RESPONSE_MASK,
    FIELD_VERSION,
    version_field,
)

DEFAULT_LEFT_PADDED_FIELDS = frozenset({FIELD_PROMPT_IDS, FIELD_PROMPT_MASK})
# per-token fields written after generation, column for column with the response
RESPONSE_ALIGNED_FIELDS = (FIELD_BEHAVIOUR_LOGPROBS, FIELD_REF_LOGPROBS)


def sample_key(pipeline: str, prompt_index: int, sample_index: int) -> str:
    """The data-plane key of one sample, unique per (pipeline, prompt, sample)."""
    if not pipeline or "/" in pipeline:
        raise ValueError(f"pipeline name must be non-empty and contain no '/': {pipeline!r}")
    if prompt_index < 0 or sample_index < 0:
        raise ValueError(f"indices must be >= 0, got prompt {prompt_index}, sample {sample_index}")
    return f"{pipeline}/p{prompt_index}/s{sample_index}"


def parse_sample_key(key: str) -> tuple[str, int, int]:
    """Inverse of ``sample_key``: (pipeline, prompt_index, sample_index)."""
    try:
        pipeline, prompt, sample = key.split("/")
        if not (prompt.startswith("p") and sample.startswith("s")):
            raise ValueError
        return pipeline, int(prompt[1:]), int(sample[1:])
    except ValueError:
        raise ValueError(f"not a sample key: {key!r}") from None


class MissingDataError(KeyError):
    """Requested keys or fields are not in the partition."""

    def __init__(self, partition: str, missing_keys: Sequence[str] = (), missing_fields: Sequence[str] = ()):
        super().__init__(partition, list(missing_keys), list(missing_fields))
        self.partition, self.missing_keys, self.missing_fields = self.args

    def __str__(self) -> str:
        if self.missing_keys:
            shown = ", ".join(self.missing_keys[:5]) + (" ..." if len(self.missing_keys) > 5 else "")
            return f"{len(self.missing_keys)} key(s) not in partition {self.partition!r}: {shown}"
        return f"field(s) {self.missing_fields} not written for every requested key in partition {self.partition!r}"


class DataPlaneUnavailable(RuntimeError):
    """The data plane cannot start or be attached to here (the cluster's fault, not a bug)."""


class DataPlane(abc.ABC):
    """Client of the data plane. See the module docstring for the semantics."""

    backend = ""  # the name connect_dataplane knows this class by
    blocking = False  # True: calls wait on the network, and async callers should run them in a thread

    def __init__(self, left_padded_fields: Iterable[str] = DEFAULT_LEFT_PADDED_FIELDS):
        self.left_padded_fields = frozenset(left_padded_fields)

    @property
    def spec(self) -> dict:
        """A small serialisable dict; ``connect_dataplane(spec)`` in another
        process (e.g. a Ray actor) returns a client of the same store."""
        return {"backend": self.backend, **self._options(), "left_padded_fields": sorted(self.left_padded_fields)}

    def _options(self) -> dict:
        return {}

    @abc.abstractmethod
    def put(self, keys: list[str], partition: str, fields: Mapping[str, Any], tags: list[dict] | None = None) -> None:
        """Store ``fields`` (dense tensors, row i belongs to ``keys[i]``) and
        merge ``tags`` (one dict per key). ``fields`` may be empty to only tag."""

    @abc.abstractmethod
    def get(self, keys: list[str], partition: str, fields: list[str]) -> dict[str, Any]:
        """Dense padded tensors, rows in the order of ``keys``."""

    @abc.abstractmethod
    def list_tags(self, partition: str) -> dict[str, dict]:
        """Every key present in ``partition`` with its merged tags."""

    def list(self, partition: str) -> list[str]:
        """The keys present in ``partition`` (an unknown partition is empty)."""
        return list(self.list_tags(partition))

    @abc.abstractmethod
    def clear(self, keys: list[str], partition: str) -> None:
        """Drop ``keys`` and their data; absent keys are ignored."""

    def service_actors(self) -> dict[str, object]:
        """The Ray actors this store lives in, by what to call them in a
        message ("storage unit TransferQueueStorageUnit#0"), for a liveness
        watch: losing one loses the samples in it. None for an in-process store."""
        return {}

    def close(self) -> None:
        """Release this client (the owner of a shared store also stops it)."""

    def __enter__(self) -> DataPlane:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# ---------------------------------------------------------------- validation


def check_keys(keys: Sequence[str]) -> list[str]:
    keys = list(keys)
    if not all(isinstance(k, str) for k in keys):
        raise TypeError("keys must be strings")
    if len(set(keys)) != len(keys):
        raise ValueError("keys must be unique within one call")
    return keys


def check_put(keys: Sequence[str], fields: Mapping[str, Any], tags: list[dict] | None) -> list[str]:
    import torch

    keys = check_keys(keys)
    for name, tensor in fields.items():
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            raise TypeError(f"field {name!r} must be a tensor with one row per key")
        if tensor.shape[0] != len(keys):
            raise ValueError(f"field {name!r} has {tensor.shape[0]} rows for {len(keys)} keys")
    if tags is not None and len(tags) != len(keys):
        raise ValueError(f"{len(tags)} tags for {len(keys)} keys")
    return keys


def check_get(keys: Sequence[str], fields: Sequence[str]) -> list[str]:
    keys = check_keys(keys)
    if not keys or not fields:
        raise ValueError("get needs at least one key and one field")
    return keys


# ----------------------------------------------------------------- padding


def pad_rows(rows: list, pad_left: bool):
    """Dense [n, longest, ...] from rows of different lengths, padded with 0.
    One allocation: on a busy machine fresh memory dominates the cost."""
    import torch

    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_side="left" if pad_left else "right")


def align_to_responses(fields: dict) -> dict:
    """Make the per-token logprob fields exactly as wide as the response mask.

    A logprob call that covered several prompt groups writes every row at
    the width of its widest response, wider than a group's own responses;
    read back alone, that group's columns must still line up. The extra
    columns are padding (zero under the mask), so trimming them is exact."""
    mask = fields.get(FIELD_RESPONSE_MASK)
    if mask is None or mask.dim() < 2:
        return fields
    width = mask.shape[1]
    for name in RESPONSE_ALIGNED_FIELDS:
        value = fields.get(name)
        if value is None or value.dim() < 2 or value.shape[1] == width:
            continue
        if value.shape[1] > width:
            fields[name] = value[:, :width]
        else:
            import torch

            fields[name] = torch.nn.functional.pad(value, (0, width - value.shape[1]))
    return fields


def refuse_stale_logprobs(fields: dict, expected: int | None = None) -> list[int]:
    """The fence before a row reaches the loss: a row whose behaviour logprobs
    were computed with other weights than generated it (a policy logprob
    stage that had moved on) would give a wrong importance ratio. Such rows
    are masked out of the loss (their response mask zeroed: they count as no
    token and no sequence) and their indices returned, for the controller to
    drop them. Rows whose behaviour logprobs came with the sample (written by
    the generator, no version field) are current by construction.
    ``expected``: the version every row must have been scored with instead
    of its generating one (``recompute = batch_start``: the trainer's)."""
    written_at = fields.get(version_field(FIELD_BEHAVIOUR_LOGPROBS))
    generated_at = fields.get(FIELD_VERSION)
    if written_at is None or generated_at is None:
        return []
    wanted = generated_at.reshape(-1) if expected is None else expected
    stale = (written_at.reshape(-1) != wanted).nonzero().reshape(-1).tolist()
    if stale:
        mask = fields[FIELD_RESPONSE_MASK].clone()
        mask[stale] = 0
        fields[FIELD_RESPONSE_MASK] = mask
    return stale
