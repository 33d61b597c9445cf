"""Turn a controller `status()` dict into text: a one-line summary and a table."""

from __future__ import annotations

from typing import Any

_LOAD_KEYS_SHOWN = 4
# What a person asks first of a worker (its queue and free memory) and of a store (its contents).
_LOAD_KEYS_FIRST = (
    "num_running",
    "num_waiting",
    "num_free_kv_blocks",
    "num_free_state_slots",
    "num_keys",
    "num_hits",
)


def status_line(status: dict[str, Any]) -> str:
    """E.g. "healthy: prefill 1/1, decode 1/1, stores 1/1, gateway up; 0 restarts", and while an
    apply runs, e.g. "decode 1/1 (wanted 2)" and "; applying: decode: add 1 replica(s)"."""
    parts = [_pool_part(name, pool) for name, pool in status["pools"].items()]
    stores = status["stores"]
    parts.append(f"stores {sum(s['healthy'] for s in stores)}/{len(stores)}")
    gateways = _gateway_rows(status)
    if len(gateways) > 1:
        parts.append(f"gateways {sum(g['healthy'] for g in gateways)}/{len(gateways)}")
    else:
        parts.append(f"gateway {'up' if gateways and gateways[0]['healthy'] else 'down'}")
    restarts = sum(p["restarts"] for p in status["pools"].values())
    restarts += sum(s["restarts"] for s in stores) + sum(g["restarts"] for g in gateways)
    state = "healthy" if status["healthy"] else "DEGRADED"
    line = f"{state}: {', '.join(parts)}; {restarts} restarts"
    apply = status.get("apply") or {}
    if apply.get("in_progress"):
        line += f"; applying: {apply.get('step') or 'planning'}"
    return line


def _pool_part(name: str, pool: dict[str, Any]) -> str:
    """E.g. "decode 2/2", "decode 1/1 (wanted 2)", "prefill 2/2 (1 outdated)"."""
    part = f"{name} {pool['num_healthy']}/{pool['replicas']}"
    notes = []
    if pool.get("desired_replicas", pool["replicas"]) != pool["replicas"]:
        notes.append(f"wanted {pool['desired_replicas']}")
    if pool.get("num_outdated"):
        notes.append(f"{pool['num_outdated']} outdated")
    return part + (f" ({', '.join(notes)})" if notes else "")


def unhealthy_parts(status: dict[str, Any]) -> str:
    """The actors that are not healthy, with their last error (for error messages)."""
    rows = [(f"{name} {w['index']}", w) for name, p in status["pools"].items() for w in p["workers"]]
    rows += [(f"store {s['index']}", s) for s in status["stores"]]
    gateways = _gateway_rows(status)
    rows += [(f"gateway {g['index']}" if len(gateways) > 1 else "gateway", g) for g in gateways]
    if status.get("ledger"):
        rows.append(("ledger", status["ledger"]))
    bad = [f"{label} ({row['error'] or 'not healthy'})" for label, row in rows if not row["healthy"]]
    return "; ".join(bad) or "everything reports healthy"


def status_table(status: dict[str, Any]) -> str:
    """One row per actor: pool, index, address, node, health, restarts, load."""
    header = ("POOL", "#", "ADDRESS", "NODE", "HEALTHY", "RESTARTS", "LOAD")
    rows: list[tuple[str, ...]] = []
    for gateway in _gateway_rows(status):
        address = gateway.get("url") or gateway["address"]
        own = gateway["stats"].get("own_address")
        if own and own != gateway["address"]:  # one of several on its port: where it alone answers
            address = f"{address} (own {own})"
        rows.append(_row("gateway", gateway, address))
    if status.get("ledger"):
        rows.append(_row("ledger", status["ledger"]))
    for name, pool in status["pools"].items():
        label = name if pool["role"] == name else f"{name} ({pool['role']})"
        rows.extend(_row(label, worker) for worker in pool["workers"])
    rows.extend(_row("store", store) for store in status["stores"])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(r, widths)).rstrip() for r in [header, *rows]]
    title = f"model {status['model']} ({status['mode']}) - {status_line(status)}"
    return "\n".join([title, *lines])


def _row(label: str, member: dict[str, Any], address: str | None = None) -> tuple[str, ...]:
    if member["healthy"]:
        health = "yes"
    elif member["given_up"]:
        health = "GAVE UP"
    else:
        health = "no"
    if member["error"] and not member["healthy"]:
        health += f" ({member['error']})"
    if member.get("outdated"):  # an apply replaces it (or stopped before it could)
        health += " (outdated)"
    idle_held = member["stats"].get("num_idle_held_slots", 0)
    if idle_held:  # slots nothing holds: they never come back (a leak), whatever health says
        health += f" (holds {idle_held} state slots with nothing running)"
    return (
        label,
        str(member["index"]),
        address or member["address"] or "-",
        member["node_ip"] or "-",
        health,
        str(member["restarts"]),
        _load(member["stats"]),
    )


def _load(stats: dict[str, Any]) -> str:
    numeric = {k: v for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    keys = [k for k in _LOAD_KEYS_FIRST if k in numeric] + [k for k in numeric if k not in _LOAD_KEYS_FIRST]
    shown = " ".join(f"{_short(k)}={numeric[k]:g}" for k in keys[:_LOAD_KEYS_SHOWN])
    return shown + (" ..." if len(keys) > _LOAD_KEYS_SHOWN else "") or "-"


def _short(key: str) -> str:
    return key.removeprefix("num_")


def _gateway_rows(status: dict[str, Any]) -> list[dict[str, Any]]:
    """Every gateway process's row (a status from before several gateways has only `gateway`)."""
    if "gateways" in status:
        return list(status["gateways"])
    return [status["gateway"]] if status["gateway"] else []
