"""What a rank's step times say about the background checkpoint writer (`writer_slowdown`), for the goodput
ledger's stall time.
"""

from __future__ import annotations


def writer_slowdown(step_times: list[tuple[float, bool]], clean_step_seconds: float | None = None
                    ) -> tuple[float, float | None]:
    """Seconds a rank's step loop lost to the background checkpoint writer, from its steps' (seconds, whether a
    write ran beside the step): what the steps beside a write took beyond the median step with none beside it,
    summed (never below 0). The median comes from these steps, else `clean_step_seconds` (an earlier call's,
    for a chunk whose every step ran beside a write); with neither, nothing can be told apart and it is 0.
    Returns (the slowdown, the median clean step to pass next time). On 2 shared cores a step's time moves
    with the machine's load too, so over a chunk this measures the writer to within that noise."""
    clean = sorted(seconds for seconds, beside_write in step_times if not beside_write)
    if clean:
        middle = len(clean) // 2
        clean_step_seconds = clean[middle] if len(clean) % 2 else (clean[middle - 1] + clean[middle]) / 2
    if clean_step_seconds is None:
        return 0.0, None
    excess = sum(seconds - clean_step_seconds for seconds, beside_write in step_times if beside_write)
    return max(0.0, excess), clean_step_seconds
