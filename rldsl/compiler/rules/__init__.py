"""Rule passes over the IR. Each pass is a pure function
``(ctx: Context) -> list[Diagnostic]``; ``ALL_PASSES`` is their order."""
