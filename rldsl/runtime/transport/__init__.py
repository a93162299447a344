"""Weight transport: the trainer's weights to their receivers, rank to rank.

A sync edge whose receivers can all take part in a collective gets one
process group of its own (``group.py``): the trainer's exporting rank is
rank 0, every receiver worker one more rank. The group is *stateless*: it
is built from a store, not through ``init_process_group``, so it lives
beside the trainer's data-parallel default group and beside any group a
receiver has. Gloo on CPU, NCCL when the tensors are on a GPU.

A push streams (``stream.py``): rank 0 packs each bucket of the size the
``.rlp`` gives into one flat byte tensor with a small header and
broadcasts it, while the next bucket is gathered; a receiver unpacks each
bucket into views of what it received, applies it and lets it go. Neither
side ever holds the whole model beyond its own copy: about two buckets in
flight on each.

This package knows torch only: no Ray, no engine, no controller. The Ray
lowering forms the groups (their stores meet through its rendezvous) and
wires the streams to the engines.
"""
