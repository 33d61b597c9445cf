"""Which token boundaries of a request get a KDA snapshot (Marconi-style selective retention)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

SKETCH_CAPACITY = 65536  # unit names remembered as seen once (16 B each: ~1 MiB with overhead)


class SeenSketch:
    """A bounded memory of prefix-unit names seen before, oldest forgotten first.

    A first sighting is only remembered here (no state is kept for it); a name seen again marks a
    junction that several requests share, which is worth a snapshot.
    """

    def __init__(self, capacity: int = SKETCH_CAPACITY) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, key: bytes) -> None:
        self._seen[key] = None
        self._seen.move_to_end(key)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)


class RetentionPolicy:
    """Plans a request's snapshot boundaries when it is admitted, from its hit onwards.

    * its input end (the prompt, plus output tokens given with it), always;
    * every `interval` tokens (0: none);
    * with `selective`, the deepest whole-unit boundary whose name was seen before (in the sketch,
      or indexed KV another request computed): a junction shared by several requests.

    The end of a finished request (prompt + reply) is retained too, by the cache, when it ends.
    So is `pre_end`, the last unit boundary before the input's last token: the deepest point an
    identical input can hit (a sample needs its last token computed), kept for this engine only.
    """

    def __init__(self, unit: int, interval: int, selective: bool, sketch: SeenSketch) -> None:
        self.unit = unit
        self.interval = interval
        self.selective = selective
        self.sketch = sketch

    def plan(
        self,
        chain: list[bytes],
        num_hit: int,
        input_end: int,
        kv_known: Callable[[bytes], bool],
        first_admission: bool = True,
    ) -> list[int]:
        """Sorted boundaries in (num_hit, input_end] to snapshot. Only a first admission looks for
        a junction: a request readmitted after preemption has seen its own units already."""
        points = {input_end}
        if self.interval:
            points.update(range(self.interval, input_end, self.interval))
        if not first_admission:
            return sorted(p for p in points if num_hit < p <= input_end)
        if self.selective:
            whole = [i for i in range(len(chain)) if (i + 1) * self.unit < input_end]
            for i in reversed(whole):
                if chain[i] in self.sketch or kv_known(chain[i]):
                    points.add((i + 1) * self.unit)
                    break
        return sorted(p for p in points if num_hit < p <= input_end)

    def pre_end(self, num_hit: int, input_end: int) -> int | None:
        """The last whole-unit boundary strictly before the input's last token, where the same
        input sent again (a retry, another sample) hits; None when it is not past `num_hit`.

        One more snapshot per prompt (a slot's size: 25,600 B for the tiny model in fp32, 41.4 MiB
        at the 48B shape in bf16) and one more prefill step (the chunk is cut there), so it is not
        dense: the unit boundary, not the token before the end, so it also serves prompts that
        share all but their last partial unit."""
        boundary = (input_end - 1) // self.unit * self.unit
        return boundary if boundary > num_hit else None

    def record(self, chain: list[bytes]) -> None:
        """An admitted request's units have been seen (once more)."""
        for key in chain:
            self.sketch.add(key)
