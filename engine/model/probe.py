"""A load-time probe shared by the checks that switch a model's path (in-place attention, fused
kernels): the same passes with the path on and off, compared within a dtype's tolerance."""

from __future__ import annotations

from collections.abc import Callable

import torch


def compare_on_probe(model, pool, switch: Callable[[bool], None], tolerance: float) -> str | None:
    """Compares the model's passes with a path switched on (switch(True)) and off on a probe over
    `pool`: contexts prefilled with it off, then ragged decode and verify batches and one
    sequence alone, each run both ways on the same inputs; what differs, or None. The path is on
    after; the probe's slots are freed."""
    vocab = model.shape.vocab_size
    contexts = [3, 21, 40, 9][:pool.max_slots]
    contexts = [min(n, pool.max_seq_len - 5) for n in contexts]
    slots = [pool.allocate_slot([])[0] for _ in contexts]

    def run(rows: list[int], chunks: list[list[int]], on: bool) -> torch.Tensor:
        starts = [pool.seq_len(slots[r]) for r in rows]
        T = max(len(c) for c in chunks)
        view = pool.view([slots[r] for r in rows], [len(c) for c in chunks], width=T,
                         tokens=[c + [0] * (T - len(c)) for c in chunks])
        switch(on)
        try:
            return model.forward(view.input_ids, view.position_ids, view, None).float()  # [b, T, V]
        finally:
            switch(True)
            for r, n in zip(rows, starts):
                pool.truncate_to(slots[r], n, keep_storage=True)
    try:
        switch(False)
        for r, n in enumerate(contexts):  # the contexts, with the path off
            view = pool.view([slots[r]], [n], tokens=[[(7 * r + j) % vocab for j in range(n)]])
            model.forward(view.input_ids, view.position_ids, view, None)
        switch(True)
        everyone = list(range(len(slots)))
        for rows, chunks in [(everyone, [[5]] * len(slots)), ([0], [[6, 7, 8]]),
                             (everyone, [[(3 * r + j) % vocab for j in range(1 + r % 4)] for r in everyone])]:
            want, got = run(rows, chunks, False), run(rows, chunks, True)
            for i, c in enumerate(chunks):
                w, g = want[i, :len(c)], got[i, :len(c)]
                worst, scale = (w - g).abs().max().item(), w.abs().max().item()
                if not worst <= tolerance * max(scale, 1.0):
                    return f"by {worst:.3g} (scale {scale:.3g}), batch {len(rows)}"
    finally:
        switch(True)
        for s in slots:
            pool.free_slot(s)
    return None
