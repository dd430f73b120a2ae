"""GET and POST /v1/placement, run on the engine thread: where each unit is now (the plan's pins and the
devices' budgets with it), and moves applied a unit at a time between two steps with every session's pages."""

from __future__ import annotations

from collections.abc import Generator

from jitllm.server.metrics import Metrics


def describe(model) -> dict:
    plan, executor = model.plan, model.executor
    units = [{"unit": str(i), "device": unit.device.name, "planned": plan.blocks[i].device,
              "pinned": plan.blocks[i].pinned, "streamed": unit.stream is not None, "bytes": unit.nbytes}
             for i, unit in enumerate(executor.blocks)]
    units.append({"unit": "head", "device": executor.head.device.name, "planned": plan.head.device,
                  "pinned": plan.head.pinned, "streamed": False, "bytes": executor.head.nbytes})
    devices = [{"name": d.name, "budget_bytes": d.budget_bytes, "used_bytes": d.used_bytes,
                "kv_budget_bytes": d.kv_budget_bytes, "kv_bytes": d.kv_bytes,
                "streaming": executor.streams[d.name].stats() if d.name in executor.streams else None}
               for d in model.devices.values()]
    return {"units": units, "devices": devices, "plan": plan.describe()}


def move(model, spec: str, metrics: Metrics, batched: bool = False) -> Generator[None, None, dict]:
    """Apply `SEL=TARGET,...` all or nothing, a unit per engine turn (Engine.call_in_pieces: the streams step
    between two units); a JitllmError names what is wrong, and nothing has moved then (what had moved is moved
    back). First, a unit a turn, the moving units' programs are loaded on their destinations (and their
    ragged variants, for a model in `batched` steps), so that the turn of a device's first unit does not
    also load its kinds there. Returns the moves and the placement after them."""
    from jitllm.runtime.engine.migration import apply_moves, planned_moves  # (they import TVM: not at start-up)

    ex = model.executor
    plan = planned_moves(model, spec)
    for index, dest, _ in plan:
        kind = ex.placed(index, dest)[0]
        if batched and dest.target.caps.ragged_batches:
            ex.program(kind.ragged_variant(), dest)
        yield
    reports = []
    for report in apply_moves(model, plan):
        reports.append(report)
        yield
    metrics.moves.inc(len(reports))
    metrics.moved_bytes.inc(sum(r.weight_bytes + r.kv_bytes + r.state_bytes for r in reports))
    return {"moves": [{"unit": str(r.unit), "from": r.source, "to": r.dest, "weight_bytes": r.weight_bytes,
                       "kv_bytes": r.kv_bytes, "state_bytes": r.state_bytes, "streamed": r.streamed,
                       "ms": round(r.seconds * 1e3, 3)}
                      for r in reports],
            "placement": describe(model)}
