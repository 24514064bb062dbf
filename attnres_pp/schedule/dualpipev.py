"""DualPipeV: DeepSeek's DualPipe cut in half, on the V-shape placement (docs/spec.md section 5).

Rank r holds chunks r and 2P - 1 - r (the V's two arms), so microbatches enter at rank 0's first
chunk and their backward starts at rank 0's second chunk: the pipeline is fed from both ends. The
steady state pairs a forward of one arm with a backward of the other (an overlapped F&B slot); the
drain splits some backwards into I and W and runs the W in what would be idle time. The order is
torch.distributed.pipelining's ScheduleDualPipeV, step for step. Pure standard library.

Pairing. An overlapped slot is emitted as its two actions, the F first and then its B, next to each
other on the rank; `dualpipev_pairs` names every such (F, B) pair. The pairing is not an IR field:
the runtime executes one action at a time on one stream either way (it already posts the sends
without waiting, which is what the slot's overlap of compute with communication buys), and the
simulator prices an F&B slot as F + B under unit costs; the torch-order test and docs read it, so
it stays beside the generator instead of travelling through every pass.
"""

from __future__ import annotations

from attnres_pp.schedule.ir import Action, B, F, I, Schedule, W


def check_dualpipev_sizes(n_stages: int, n_virtual: int, n_microbatches: int) -> None:
    """Refuse what DualPipeV cannot run: V != 2 (a V has two arms) and m < 2P (the steady state
    needs every one of the 2P chunks busy with a distinct microbatch, torch's rule)."""
    if n_virtual != 2:
        raise ValueError(f"dualpipev places exactly 2 chunks per rank (a V), but virtual V={n_virtual}: "
                         "use virtual=2")
    if n_microbatches < 2 * n_stages:
        raise ValueError(f"dualpipev needs m >= 2P={2 * n_stages} microbatches (one per chunk in the steady "
                         f"state), got m={n_microbatches}: use any m >= {2 * n_stages}")


def dualpipev(n_stages: int, n_virtual: int, n_microbatches: int) -> Schedule:
    """DualPipeV for P ranks, V = 2, m >= 2P microbatches (placement vshape)."""
    check_dualpipev_sizes(n_stages, n_virtual, n_microbatches)
    rank_actions = tuple(tuple(_rank_order(r, n_stages, n_microbatches)[0]) for r in range(n_stages))
    return Schedule(name="dualpipev", n_stages=n_stages, n_virtual=2, n_microbatches=n_microbatches,
                    rank_actions=rank_actions, placement="vshape")


def dualpipev_pairs(n_stages: int, n_microbatches: int) -> tuple[tuple[tuple[Action, Action], ...], ...]:
    """Per rank, the (F, B) pairs DualPipeV overlaps in one slot, in the rank's order; in the
    schedule each pair's B directly follows its F."""
    check_dualpipev_sizes(n_stages, 2, n_microbatches)
    return tuple(tuple(_rank_order(r, n_stages, n_microbatches)[1]) for r in range(n_stages))


def _rank_order(pp_rank: int, n_stages: int, n_microbatches: int) -> tuple[list[Action], list[tuple[Action, Action]]]:
    """Rank pp_rank's actions and its overlapped pairs. Steps as torch numbers them: 1 F of the
    first arm; 2 F first, F second; 3 I W F on the second arm (zero bubble); 4 the paired main
    step; 5 B second, paired F second + B first; 6 B second, B first, switching to I halfway;
    7 W, then the first arm's backward; 8 the W still held."""
    arm = (pp_rank, 2 * n_stages - 1 - pp_rank)  # local chunk 0 and 1
    forwards, backwards = [0, 0], [0, 0]  # next microbatch per arm (B and I share one counter)
    held: list[tuple[int, int]] = []  # (arm, microbatch) whose I ran and W has not
    actions: list[Action] = []
    pairs: list[tuple[Action, Action]] = []

    def forward(v: int) -> Action:
        actions.append(F(arm[v], forwards[v]))
        forwards[v] += 1
        return actions[-1]

    def backward(v: int, split: bool = False) -> Action:
        mb = backwards[v]
        backwards[v] += 1
        actions.append((I if split else B)(arm[v], mb))
        if split:
            held.append((v, mb))
        return actions[-1]

    def weight() -> None:
        if held:
            v, mb = held.pop(0)
            actions.append(W(arm[v], mb))

    def paired(forward_arm: int) -> None:
        pairs.append((forward(forward_arm), backward(1 - forward_arm)))

    for _ in range(2 * (n_stages - pp_rank - 1)):
        forward(0)
    for _ in range(pp_rank + 1):
        forward(0)
        forward(1)
    for _ in range(n_stages - pp_rank - 1):
        backward(1, split=True)
        weight()
        forward(1)
    for step in range(n_microbatches - 2 * n_stages + pp_rank + 1):
        if step == 0 and pp_rank == n_stages - 1:
            forward(0)  # not paired: the last rank's first slot would only wait (torch's note)
            backward(1)
        else:
            paired(0)
        paired(1)
    for _ in range(n_stages - pp_rank - 1):
        backward(1)
        paired(1)
    n_last = pp_rank + 1
    split = False
    for step in range(n_last):
        if step == n_last // 2 and pp_rank % 2 == 1:
            split = True
        backward(1, split)
        if step == n_last // 2 and pp_rank % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(n_stages - pp_rank - 1):
        weight()
        backward(0, split)
    for _ in range(pp_rank + 1):
        weight()
    return actions, pairs
