"""Counters and timings of one generation, and the one-line summary the CLI prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    """Counts and seconds; `accepted` counts draft tokens the target kept (bonus tokens excluded)."""

    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens decoded (the rest: cached)
    cached_tokens: int = 0  # prompt tokens whose KV entries were reused from the previous generation
    generated_tokens: int = 0
    # tokens the target's passes committed: the generated ones, and the stop token (or a stop string's step's last
    # ones) that ended the run: each pass commits at least one, so tok/pass is never below 1 (plain decoding: 1.00)
    committed_tokens: int = 0
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    prefill_seconds: float = 0.0
    generation_seconds: float = 0.0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    method: str = ""
    decision: str = ""  # what `auto` drafted from, or why it drafted nothing (AutoPolicy.decision); else empty
    # a target on RPC servers: their slowest handshake round trip, measured at load. The link's latency beside the
    # time per pass; llama.cpp does not say how much of a pass was spent waiting on the network
    rpc_round_trip_ms: float = 0.0
    # [i]: passes whose draft position i was judged (drafted, all before it kept) / kept
    judged_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        """One target pass that verified `drafted` tokens and kept the first `accepted` of them."""
        self.target_passes += 1
        self.committed_tokens += accepted + 1
        if not drafted:
            return
        self.drafted += drafted
        self.accepted += accepted
        judged = min(drafted, accepted + 1)
        for counts, n in ((self.judged_at, judged), (self.accepted_at, accepted)):
            counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    @property
    def acceptance_by_position(self) -> list[float]:
        """Chance that draft position i is kept, given that the target judged it."""
        kept = self.accepted_at + [0] * (len(self.judged_at) - len(self.accepted_at))
        return [a / j for a, j in zip(kept, self.judged_at)]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target pass, a stop token too (1.0 for autoregressive decoding)."""
        return self.committed_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generated_tokens / self.generation_seconds if self.generation_seconds else 0.0

    @property
    def engine_seconds(self) -> float:
        """Generation time spent outside the draft's and the target's llama.cpp decodes."""
        return max(0.0, self.generation_seconds - self.draft_seconds - self.target_seconds)

    def to_dict(self) -> dict[str, float]:
        out = asdict(self)
        for name in ("acceptance_rate", "mean_accepted_length", "prefill_tps", "generation_tps", "engine_seconds",
                     "acceptance_by_position"):
            out[name] = getattr(self, name)
        return out

    def line(self) -> str:
        s = (
            f"prompt {self.prompt_tokens} tok"
            + (f" ({self.cached_tokens} cached)" if self.cached_tokens else "")
            + f" @ {self.prefill_tps:.1f} tok/s | "
            f"generated {self.generated_tokens} tok @ {self.generation_tps:.2f} tok/s | "
            f"{self.target_passes} target passes, {self.mean_accepted_length:.2f} tok/pass"
        )
        if self.drafted:
            by_pos = "/".join(f"{a:.0%}".rstrip("%") for a in self.acceptance_by_position)
            s += f" | acceptance {self.acceptance_rate:.1%} ({self.accepted}/{self.drafted}), by position {by_pos}%"
        if self.decision:
            s += f" | {self.decision}"
        t = self.generation_seconds or 1.0
        s += (f" | time: target {self.target_seconds / t:.0%}, draft {self.draft_seconds / t:.0%}, "
              f"engine {self.engine_seconds / t:.0%}")
        if self.rpc_round_trip_ms:
            s += (f" | RPC: {self.target_seconds * 1e3 / max(1, self.target_passes):.1f} ms per target pass, "
                  f"{self.rpc_round_trip_ms:.2f} ms round trip")
        return s
