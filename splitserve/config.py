"""The cluster config: one YAML file, validated at load, frozen afterwards.

`load_config(path)` reads a file into a `ClusterConfig` or raises one `ConfigError` that names the
file, each offending key (as a dotted path) and what is wrong with it. `default_config()` is the
embedded default (the same as `deploy/configs/default.yaml`): the tiny model on one machine's
CPUs. `ClusterConfig.engine_config(pool)` derives one pool's `EngineConfig`.

Torch-free: the model path of the default is only resolved (and the tiny model built) when a
caller asks for it through `ModelConfig.resolved_path()`.
"""

from __future__ import annotations

import difflib
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
    model_validator,
)

from splitserve.engine_config import EngineConfig

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "default_config",
    "format_bytes",
    "load_config",
    "parse_bytes",
]

DEFAULT_MODEL_NAME = "tiny-kimi-linear"  # the folder name of splitserve.default_model's model

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


class ConfigError(ValueError):
    """A config file that cannot be served: the message names the file, the key and the fix."""


def parse_bytes(value: object) -> int:
    """Parse a byte size: an int, or a string like "2GiB", "512MiB", "1.5GB", "4096"."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a byte size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte size cannot be negative (got {value})")
        return value
    if isinstance(value, str):
        match = _BYTES_RE.match(value)
        unit = match.group(2).lower() if match else ""
        if match and unit in _UNITS:
            try:
                amount = Decimal(match.group(1)) * _UNITS[unit]
            except InvalidOperation:  # pragma: no cover - the regex admits only decimals
                amount = Decimal("NaN")
            if amount == amount.to_integral_value():
                return int(amount)
            raise ValueError(f"{value!r} is not a whole number of bytes")
    raise ValueError(
        f"{value!r} is not a byte size; write an integer or a number with a unit "
        "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 2GiB, 512MiB, 1.5GB"
    )


def format_bytes(num_bytes: int) -> str | int:
    """The shortest exact binary-unit spelling ("2GiB"), or the int itself where none is exact."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size and num_bytes % size == 0:
            return f"{num_bytes // size}{unit}"
    return num_bytes


# An int in Python; written back as "2GiB" when dumped to YAML/JSON, so files round-trip.
ByteSize = Annotated[int, BeforeValidator(parse_bytes), PlainSerializer(format_bytes, when_used="json")]
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Section):
    """Which checkpoint every pool serves (one model for the whole cluster, so pools agree)."""

    path: str | None = None  # None: the embedded tiny model (built on first use)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    name: str | None = None  # the served model name; default: the checkpoint's folder name
    max_model_len: int | None = Field(default=None, ge=2)

    def resolved_path(self) -> str:
        """The checkpoint folder; for the default this builds the tiny model if it is missing."""
        if self.path is None:
            from splitserve.default_model import default_model_path

            return str(default_model_path())
        return str(Path(self.path).expanduser())

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        if self.path is None:
            return DEFAULT_MODEL_NAME
        return Path(self.path).expanduser().name or self.path


class GatewayConfig(_Section):
    """The OpenAI-compatible HTTP frontend (GPU-less, one per cluster, on the head node)."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: any free port
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    num_cpus: float = Field(default=0.25, ge=0)
    # a request body past this is a 413 before its JSON is parsed
    max_request_bytes: ByteSize = Field(default=8 * 2**20, ge=1)
    # a text prompt past this many characters is a 400 before it is tokenized; null: 32 per context token
    max_prompt_chars: int | None = Field(default=None, ge=1)
    # requests past the decode pool's room wait in a FIFO queue this long at most; past it, 429
    max_queued_requests: int = Field(default=1024, ge=0)
    # Slow and idle clients. A request's line and headers must arrive within header_read_timeout_s
    # (a new connection that sends nothing is closed after it); a body may fall silent for at most
    # body_read_timeout_s; the whole request must arrive within request_read_timeout_s; an idle
    # connection between requests is closed after keep_alive_timeout_s. Past these, a 408 and close.
    header_read_timeout_s: float = Field(default=30, gt=0)
    body_read_timeout_s: float = Field(default=30, gt=0)
    request_read_timeout_s: float = Field(default=120, gt=0)
    keep_alive_timeout_s: float = Field(default=30, gt=0)
    # open connections one client address may hold; past it, a 429 and close; null: no cap
    max_connections_per_client: int | None = Field(default=1024, ge=1)


class PoolConfig(_Section):
    """One worker pool: how many replicas, what each reserves from Ray, and its engine knobs.

    The replicas of a pool share one Ray placement group per resize step, with `placement` as
    its strategy (PACK: fill nodes in turn; STRICT_SPREAD: one replica per node). `resources`
    are custom Ray resources each replica's bundle reserves besides its CPUs and GPUs, which
    keeps the pool to the nodes started with them (`ray start --resources`).
    """

    replicas: int = Field(default=1, ge=0)
    num_cpus: float = Field(default=1, gt=0)
    num_gpus: float = Field(default=0, ge=0)
    tensor_parallel: int = Field(default=1, ge=1)
    placement: PlacementStrategy = "PACK"
    resources: dict[str, float] = Field(default_factory=dict)  # e.g. {"decode_host": 1}
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    kv_cache_memory_bytes: ByteSize = 256 * 2**20
    block_size: int = Field(default=16, ge=1)
    # how a decoding request that runs out of KV blocks is preempted: recompute (its state is freed,
    # prompt + outputs computed again) or swap (its state waits in the node's store, or for a
    # colocated worker in `swap_space_bytes` of host memory, and is copied back: no recompute)
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    swap_space_bytes: ByteSize = 4 * 2**30
    # what `config plan` and `up` check the weights, cache and activations against (one GPU, or
    # the host's RAM for a CPU pool); None: the device visible where the plan is made
    device_memory_bytes: ByteSize | None = None

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU"):
                raise ValueError(f"{name!r} is not a custom resource: set num_{name.lower()}s instead")
            if not name or amount <= 0:
                raise ValueError(f"each resource needs a name and an amount above 0 (got {name!r}: {amount})")
        return value

    @field_validator("tensor_parallel")
    @classmethod
    def _single_rank(cls, value: int) -> int:
        if value > 1:
            raise ValueError(
                f"tensor_parallel > 1 is not supported yet (got {value}); scale out with replicas"
            )
        return value


class DiskConfig(_Section):
    """The store's disk tier; `path: null` turns it off."""

    # {user} and {deployment} are filled in as a deployment starts (deploy/launcher.py): two never share one
    path: str | None = "/tmp/splitserve-store-{user}/{deployment}"
    bytes: ByteSize = 20 * 2**30


class StoreConfig(_Section):
    """The state store: one actor per node that hosts a worker (host RAM first, then disk)."""

    memory_bytes: ByteSize = 2 * 2**30
    disk: DiskConfig = DiskConfig()
    # a state key's lease runs from its writer's first Allocate, at the prefill's start: a 32k-token
    # prompt's prefill on a CPU takes minutes, so the lease matches the gateway's whole-request limit
    lease_s: float = Field(default=600, gt=0)
    num_cpus: float = Field(default=0.25, ge=0)
    # Serves the store's shared-memory arena to readers on other nodes: "mooncake" (the
    # `mooncake` extra, needs libibverbs) or "none" (they get the bytes over gRPC).
    transfer_engine: Literal["none", "mooncake"] = "none"


class PrefillPoolConfig(PoolConfig):
    """The prefill pool: a `PoolConfig` plus what only prefill workers do.

    `fallback` says what the gateway does while the pool has no worker: `decode_local` (the
    decode worker computes the prompt itself) or `fail` (503 naming the empty pool).
    """

    fallback: Literal["decode_local", "fail"] = "decode_local"


class DecodePoolConfig(PoolConfig):
    """The decode pool: a `PoolConfig` plus what only decode workers do.

    `failover`: when a decode worker is lost mid-stream, the gateway resumes each of its
    requests on another worker (from the lost worker's stored state when it kept one, else by
    re-prefill of prompt + the tokens already sent; the stream goes on with no token repeated or
    missing); false ends those streams with a 503 error event.
    `failover_wait_s`: how long such a stream may wait for a decode worker to resume on (all
    others full or unreachable, or the only one being restarted by the controller), and how long
    a new request waits for one to be reachable at all, trying again with a growing backoff; the
    request's own timeout bounds it too.
    `replay_window`: KDA decode in ReplaySSM form with a ring of this many step records
    (engine/replay_ring.py); each decode worker then keeps every request's state in its node's
    store as it decodes (prompt state + a piece every window, decode_worker/replay_publisher.py),
    and a failover resumes from it, recomputing fewer than this many tokens. 0 (the default) runs
    the plain recurrent path and failover re-prefills: on a CPU the rings cost about 20% of a
    tiny model's decode step (docs/PERFORMANCE.md sections 7 and 8).
    """

    failover: bool = True
    failover_wait_s: float = Field(default=60.0, ge=0)
    # ReplaySSM: KDA decode keeps a checkpoint + a ring of this many step records per layer
    # (0: the plain recurrent path)
    replay_window: int = Field(default=0, ge=0)


class CacheConfig(_Section):
    """Hybrid prefix caching (docs/ARCHITECTURE.md, "Prefix caching").

    A prefix is named by a chain of hashes, one per `prefix_unit` prompt tokens; it is reusable
    only where every MLA layer's KV and a KDA state snapshot at that exact boundary both exist.
    Snapshots are kept at every prompt end and at the end of every finished request (prompt +
    reply); every `retention_interval` tokens (0: none); and, with `selective_retention`, at a
    boundary the engine has seen a second time. `snapshot_memory_bytes` is each worker's pool
    for them (on top of `<pool>.kv_cache_memory_bytes`).
    """

    enable_prefix_caching: bool = True
    prefix_unit: int = Field(default=64, ge=1)
    retention_interval: int = Field(default=0, ge=0)
    selective_retention: bool = True
    snapshot_memory_bytes: ByteSize = 64 * 2**20


class RouterConfig(_Section):
    """How the gateway picks workers: `prefix_aware` (matched prefix tokens balanced against
    load), `least_load` or `round_robin`.

    `local_prefill_max_tokens` (conditional disaggregation): a prompt of which at most this many
    tokens are not already cached on a decode worker with room is computed by that decode worker
    itself, with no prefill worker and no state handoff (the next turn of a conversation, whose
    history the decode worker kept when the last turn finished; a short prompt). The decode
    worker checks its own cache and refuses when it holds less than the gateway believed; the
    prompt then goes to a prefill worker as usual. Each such prefill runs in the decode batch,
    so it is bounded: 0 (the default) sends every prompt to a prefill worker.
    """

    policy: Literal["prefix_aware", "least_load", "round_robin"] = "prefix_aware"
    local_prefill_max_tokens: int = Field(default=0, ge=0)


class HealthConfig(_Section):
    """How the controller watches and stops its actors: a `health()` call every `interval_s`,
    each allowed `timeout_s`; a dead or failing actor is restarted at most `max_restarts` times.
    Only restarts within the last `restart_window_s` count against `max_restarts`.
    `start_timeout_s` bounds an actor's `start()` (which loads the model). On stop, and for the
    workers a scale-down removes, requests in flight get `drain_timeout_s` to finish."""

    interval_s: float = Field(default=5, gt=0)
    # stats() answers from the engine's last snapshot, not behind its step; a stuck engine shows
    # as a step running past 30 x timeout_s (deploy/health.py)
    timeout_s: float = Field(default=10, gt=0)
    max_restarts: int = Field(default=3, ge=0)
    # restarts older than this no longer count against max_restarts (0: every restart ever counts),
    # so a worker that crashes once a day is not given up on after three days
    restart_window_s: float = Field(default=600, ge=0)
    start_timeout_s: float = Field(default=300, gt=0)
    drain_timeout_s: float = Field(default=30, ge=0)


class ClusterConfig(_Section):
    """A whole deployment. Frozen; the cross-checks below run at construction.

    In `colocated` mode every `prefill` replica also decodes (one worker runs both phases), so
    the `decode` section must be absent or say `replicas: 0`.
    """

    model: ModelConfig = ModelConfig()
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    gateway: GatewayConfig = GatewayConfig()
    prefill: PrefillPoolConfig = PrefillPoolConfig()
    decode: DecodePoolConfig = DecodePoolConfig()
    store: StoreConfig = StoreConfig()
    cache: CacheConfig = CacheConfig()
    router: RouterConfig = RouterConfig()
    health: HealthConfig = HealthConfig()

    @model_validator(mode="before")
    @classmethod
    def _colocated_has_no_decode_pool(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("mode") == "colocated" and data.get("decode") is None:
            data = {**data, "decode": {"replicas": 0}}
        return data

    @model_validator(mode="after")
    def _cross_check(self) -> ClusterConfig:
        if self.mode == "colocated" and self.decode.replicas != 0:
            raise ValueError(
                f"decode.replicas: colocated mode runs both phases in each prefill replica, so "
                f"there is no decode pool; remove the decode section or set decode.replicas: 0 "
                f"(got {self.decode.replicas})"
            )
        for name in self.pool_names:
            pool: PoolConfig = getattr(self, name)
            if pool.replicas < 1:
                raise ValueError(f"{name}.replicas: must be at least 1 (got {pool.replicas})")
            if self.cache.prefix_unit % pool.block_size:
                raise ValueError(
                    f"cache.prefix_unit: must be a multiple of {name}.block_size "
                    f"({pool.block_size}; got {self.cache.prefix_unit})"
                )
        if self.cache.retention_interval % self.cache.prefix_unit:
            raise ValueError(
                f"cache.retention_interval: must be a multiple of cache.prefix_unit "
                f"({self.cache.prefix_unit}; got {self.cache.retention_interval})"
            )
        return self

    @property
    def pool_names(self) -> tuple[str, ...]:
        """The pools that run: ("prefill", "decode"), or ("prefill",) in colocated mode."""
        return ("prefill",) if self.mode == "colocated" else ("prefill", "decode")

    def pool_role(self, pool: str) -> str:
        """What the pool's workers do: "prefill", "decode" or (colocated mode) "colocated"."""
        self._check_pool(pool)
        return "colocated" if self.mode == "colocated" else pool

    def pool(self, pool: str) -> PoolConfig:
        self._check_pool(pool)
        return getattr(self, pool)  # type: ignore[no-any-return]

    def engine_config(self, pool: str, *, model_path: str | None = None) -> EngineConfig:
        """The engine knobs of one pool's workers. `model_path` skips resolving the model again."""
        section = self.pool(pool)
        on_gpu = section.num_gpus > 0
        return EngineConfig(
            model=model_path if model_path is not None else self.model.resolved_path(),
            dtype=self.model.dtype,
            device="cuda" if on_gpu else "cpu",
            max_num_seqs=section.max_num_seqs,
            max_num_batched_tokens=section.max_num_batched_tokens,
            kv_cache_memory_bytes=section.kv_cache_memory_bytes,
            block_size=section.block_size,
            preemption_mode=section.preemption_mode,
            swap_space_bytes=section.swap_space_bytes,
            max_model_len=self.model.max_model_len,
            num_threads=None if on_gpu else max(1, int(section.num_cpus)),
            enable_prefix_caching=self.cache.enable_prefix_caching,
            prefix_unit=self.cache.prefix_unit,
            retention_interval=self.cache.retention_interval,
            selective_retention=self.cache.selective_retention,
            snapshot_memory_bytes=self.cache.snapshot_memory_bytes,
            prefix_salt=self.model.served_name,  # the gateway's salt: engines name what they retain alike
            replay_window=getattr(section, "replay_window", 0),  # a decode pool's key only
            enforce_eager=self.pool_role(pool) == "prefill",  # never runs a decode-only step: no graphs
        )

    def to_yaml(self) -> str:
        """The config as YAML that `load_config` reads back to an equal config."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def _check_pool(self, pool: str) -> None:
        if pool not in self.pool_names:
            raise ValueError(f"no pool {pool!r} in {self.mode} mode; pools: {', '.join(self.pool_names)}")


def default_config() -> ClusterConfig:
    """The embedded default: the tiny model, one prefill and one decode worker on CPUs."""
    return ClusterConfig()


def load_config(path: str | Path) -> ClusterConfig:
    """Read and validate one YAML file; raise `ConfigError` naming the file, key and problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{path}: not valid YAML{at}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (got {type(data).__name__})")
    return parse_config(data, source=str(path))


def parse_config(data: dict[str, Any], *, source: str = "<config>") -> ClusterConfig:
    """Validate an already-parsed mapping; errors are reported as coming from `source`."""
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        problems = [_describe(error) for error in exc.errors()]
        if len(problems) == 1:
            raise ConfigError(f"{source}: {problems[0]}") from None
        listing = "\n".join(f"  - {problem}" for problem in problems)
        raise ConfigError(f"{source}: {len(problems)} problems:\n{listing}") from None


def with_gateway_address(config: ClusterConfig, *, host: str | None, port: int | None) -> ClusterConfig:
    """A validated copy of `config` whose gateway listens at `host`/`port` (None keeps the config's)."""
    if host is None and port is None:
        return config
    data = config.model_dump(mode="json")
    data["gateway"].update({k: v for k, v in (("host", host), ("port", port)) if v is not None})
    return parse_config(data, source="--host/--port")


def _describe(error: Any) -> str:
    loc = tuple(error["loc"])
    key = ".".join(str(part) for part in loc)
    if error["type"] == "extra_forbidden":
        known = _known_keys(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
        return f"{key}: unknown key ({hint})"
    if error["type"] == "value_error":
        message = str(error["ctx"]["error"])
        return f"{key}: {message}" if key else message
    return f"{key}: {error['msg']} (got {error['input']!r})"


def _known_keys(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = ClusterConfig
    for part in loc:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)
