"""Time ONE training step: non-private SGD vs our DP step vs Opacus (hooks and ghost clipping).

Honest comparison, same work per step for every implementation:
  - same model architecture and initial weights, same batch (x, y), same thread count (2);
  - a FIXED-size batch for every implementation (Poisson sampling is left out of all of them:
    it is data indexing, identical work for each, and variable sizes would only add noise);
  - the DP implementations each clip per example, add Gaussian noise to the sum and take the
    optimizer step; ours is the trainer's step (`fedprivacy.training.stack.ClientStack`, one
    client) with its noise words drawn as the trainer draws them: a ChaCha20 stream under a fresh
    OS key, the `--inner` steps of a timed repeat in one pass (the trainer draws a round's steps in
    one pass), and the release rounded exactly to its grid (`fedprivacy.training.noise`);
  - `fedprivacy-torchrng` is the same step with its words from a weak source (torch's generator
    reseeded from 64 bits of OS entropy every step, which keeps only 32 of them on the CPU): the
    ratio of the two is what the cipher costs;
  - the non-private step is zero_grad + forward + mean cross-entropy + backward + torch SGD step.
Repeats are interleaved (round-robin over implementations) so load from other processes on the
shared machine hits all of them alike; we report the median over repeats after warm-up. With
`--device cuda` everything (models, batches, our noise generator) lives on the GPU and each timed
repeat ends with a device synchronisation, so queued kernels are counted.

Usage: python benchmarks/step_overhead.py [--device cpu|cuda] [--threads 2] [--repeats 31] [--inner 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import secrets
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedprivacy.models import build_model
from fedprivacy.privacy.plan import Plan
from fedprivacy.training import ClientStack, DPTrainer, StepInputs, StepRandomness
from fedprivacy.training.noise import NoiseAhead, noise_ahead
from fedprivacy.training.rng import noise_width
from fedprivacy.training.stack import noise_scale

CASES = [  # (model, num_features, num_classes, input shape)
    ("logreg", 15, 2, (15,)),
    ("mlp", 15, 2, (15,)),
    ("cnn", 64, 10, (1, 8, 8)),
]
BATCHES = (64, 256)
SIGMA, CLIP, LR = 1.0, 1.0, 0.05


def nonprivate_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, block: int) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def os_entropy_words(count: int, device: torch.device, block: int) -> Callable[[], tuple[torch.Tensor, NoiseAhead]]:
    """Our noise, as the trainer draws it: `block` steps per pass under a fresh OS key, their
    Box–Muller made at once (`noise_ahead`)."""
    randomness, step, draws, ahead = StepRandomness(), 0, None, None
    std = noise_scale(torch.tensor([SIGMA], dtype=torch.float64, device=device), CLIP)

    def next_words() -> tuple[torch.Tensor, NoiseAhead]:
        nonlocal step, draws, ahead
        if draws is None or step >= draws.first_step + len(draws.noise):
            draws = randomness.draws(step, block, 0, 1.0, count, device=device)
            ahead = noise_ahead(draws.noise, std.expand(len(draws.noise)))
        row = step - draws.first_step
        step += 1
        return draws.noise[row], ahead.row(row)

    return next_words


def torch_generator_words(
    count: int, device: torch.device, block: int
) -> Callable[[], tuple[torch.Tensor, NoiseAhead]]:
    """A weak source of the same words: torch's generator reseeded from 64 bits of OS entropy every
    step (it keeps only 32 of them on the CPU)."""
    generator = torch.Generator(device=device)
    std = noise_scale(torch.tensor([SIGMA], dtype=torch.float64, device=device), CLIP)

    def next_words() -> tuple[torch.Tensor, NoiseAhead]:
        generator.manual_seed(secrets.randbits(64))
        words = torch.randint(-(2**63), 2**63 - 1, (1, noise_width(count)), generator=generator, device=device)
        return words[0], noise_ahead(words, std)

    return next_words


def dp_step_with(words: Callable[[int, torch.device, int], Callable[[], tuple[torch.Tensor, NoiseAhead]]]):
    """The trainer's step: the stack of one client on the model's own weights (`ClientStack`)."""

    def build(model: nn.Module, x: torch.Tensor, y: torch.Tensor, block: int) -> Callable[[], None]:
        stack = ClientStack(model, stacked=False)
        state = [t.unsqueeze(0) for t in model.state_dict().values()]
        next_words = words(stack.noise_count, x.device, block)
        one = {"dtype": torch.float64, "device": x.device}
        clip = torch.tensor([CLIP], **one)
        fixed = (noise_scale(torch.tensor([SIGMA], **one), clip), clip, torch.tensor([float(len(x))], device=x.device))
        valid = torch.ones((1, len(x)), dtype=torch.bool, device=x.device)
        active, rate = torch.ones(1, dtype=torch.bool, device=x.device), torch.full((1,), LR, device=x.device)
        refiners = [StepRandomness().refiner(0)]

        def step() -> None:
            words, ahead = next_words()
            inputs = StepInputs(x[None], y[None], valid, words[None], *fixed, active, refiners, ahead)
            stack.step(state, inputs, lambda released: rate)

        return step

    return build


def opacus_step(mode: str) -> Callable[[nn.Module, torch.Tensor, torch.Tensor, int], Callable[[], None]]:
    def build(model: nn.Module, x: torch.Tensor, y: torch.Tensor, block: int) -> Callable[[], None]:
        from opacus import PrivacyEngine

        # A loader of exactly one batch: sample rate 1, so Opacus divides by len(x) like ours.
        loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        made = PrivacyEngine().make_private(
            module=model,
            optimizer=opt,
            criterion=nn.CrossEntropyLoss(),
            data_loader=loader,
            noise_multiplier=SIGMA,
            max_grad_norm=CLIP,
            poisson_sampling=False,
            grad_sample_mode=mode,
        )
        module, dp_opt = made[0], made[1]
        criterion = made[2] if mode == "ghost" else nn.CrossEntropyLoss()

        def step() -> None:
            dp_opt.zero_grad(set_to_none=True)
            criterion(module(x), y).backward()
            dp_opt.step()

        return step

    return build


IMPLS = {
    "nonprivate": nonprivate_step,
    "fedprivacy": dp_step_with(os_entropy_words),
    "fedprivacy-torchrng": dp_step_with(torch_generator_words),
    "opacus-hooks": opacus_step("hooks"),
    "opacus-ghost": opacus_step("ghost"),
}


def synchronise(device: torch.device) -> None:
    """Wait for queued GPU kernels, so a timed repeat counts the work it launched."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(repeats: int, inner: int, device: torch.device) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for name, features, classes, shape in CASES:
        for batch in BATCHES:
            torch.manual_seed(0)
            base = build_model(name, features, classes).to(device)
            x = torch.randn(batch, *shape, device=device)
            y = torch.randint(0, classes, (batch,), device=device)
            steps = {impl: make(copy.deepcopy(base), x, y, inner) for impl, make in IMPLS.items()}
            times: dict[str, list[float]] = {impl: [] for impl in steps}
            for step in steps.values():  # warm-up
                for _ in range(inner):
                    step()
            synchronise(device)
            for _ in range(repeats):  # interleaved repeats
                for impl, step in steps.items():
                    start = time.perf_counter()
                    for _ in range(inner):
                        step()
                    synchronise(device)
                    times[impl].append((time.perf_counter() - start) / inner * 1e3)
            base_ms = statistics.median(times["nonprivate"])
            replaced_ms = statistics.median(times["fedprivacy-torchrng"])
            for impl, values in times.items():
                ms = statistics.median(values)
                rows.append(
                    {
                        "model": name,
                        "batch": batch,
                        "impl": impl,
                        "ms_per_step": round(ms, 4),
                        "ratio_vs_nonprivate": round(ms / base_ms, 3),
                        "ratio_vs_torchrng": round(ms / replaced_ms, 3),
                    }
                )
    return rows


def print_table(rows: list[dict[str, object]]) -> None:
    print(f"{'model':<8}{'batch':>6}  {'impl':<21}{'ms/step':>10}{'× non-private':>15}{'× torch-rng DP step':>21}")
    for r in rows:
        print(
            f"{r['model']:<8}{r['batch']:>6}  {r['impl']:<21}"
            f"{r['ms_per_step']:>10.3f}{r['ratio_vs_nonprivate']:>15.2f}{r['ratio_vs_torchrng']:>21.3f}"
        )


class TorchGeneratorRandomness(StepRandomness):
    """A weak source behind the trainer's own interface: each step's keystream bytes from torch's
    generator reseeded from 64 bits of OS entropy; the sample's comparison and the noise's
    Box–Muller are the trainer's own. Its words are made on the CPU (the rounds run there)."""

    @property
    def seeded(self) -> bool:
        return True  # a stream that fills its own steps (`fill_steps`), as a seeded one does

    def fill_steps(self, first_step: int, steps: int, blocks: int, out: memoryview) -> None:
        generator, size = torch.Generator(), blocks * 64
        for step in range(steps):
            generator.manual_seed(secrets.randbits(64))
            words = torch.randint(-(2**63), 2**63 - 1, (blocks * 8,), generator=generator)
            out[step * size : (step + 1) * size] = words.numpy().tobytes()


def measure_rounds(repeats: int, steps: int, device: torch.device) -> list[dict[str, object]]:
    """A round of `steps` steps through `DPTrainer` (sampling, clipping, noise, update), with our
    noise and with the replaced generator, interleaved: what strong noise costs a client's round."""
    rows = []
    for name, n in (("logreg", 1000), ("mlp", 1000)):
        plan = Plan(
            client_id="bench",
            rule="calibrated",
            n=n,
            epsilon=1.0,
            delta=1e-5,
            clip_norm=CLIP,
            sigma=SIGMA,
            sampling_rate=64 / n,
            steps=steps,
            rounds=1,
            noise_segments=((SIGMA, steps),),
            epsilon_pld=1.0,
            epsilon_rdp=1.0,
            learning_rate=LR,
        )
        torch.manual_seed(0)
        x, y = torch.randn(n, 15, device=device), torch.randint(0, 2, (n,), device=device)
        trainers = {}
        for label, randomness in (
            ("fedprivacy", StepRandomness()),
            ("fedprivacy-torchrng", TorchGeneratorRandomness()),
        ):
            torch.manual_seed(0)
            trainer = DPTrainer(build_model(name, 15, 2).to(device), plan, x, y)
            trainer.randomness = randomness
            trainers[label] = trainer
        times: dict[str, list[float]] = {label: [] for label in trainers}
        for repeat in range(repeats + 3):  # the first 3: warm-up
            for label, trainer in trainers.items():
                trainer.load_state_dict({"step": 0})
                start = time.perf_counter()
                trainer.run_steps(steps)
                synchronise(device)
                if repeat >= 3:
                    times[label].append((time.perf_counter() - start) / steps * 1e3)
        replaced = statistics.median(times["fedprivacy-torchrng"])
        for label, values in times.items():
            ms = statistics.median(values)
            rows.append(
                {
                    "model": name,
                    "round_steps": steps,
                    "impl": label,
                    "ms_per_step": round(ms, 4),
                    "ratio_vs_torchrng": round(ms / replaced, 3),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=31, help="interleaved timed repeats")
    parser.add_argument("--inner", type=int, default=10, help="steps per timed repeat")
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where models and batches live")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (1 on a busy machine)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible (CUDA_VISIBLE_DEVICES, driver?)")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # Opacus warns about secure_mode and the accountant
    device = torch.device(args.device)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}")
    rows = measure(args.repeats, args.inner, device)
    print_table(rows)
    # the rounds' weak source makes its words on the CPU: they are compared there only
    rounds = measure_rounds(args.repeats, args.inner, torch.device("cpu"))
    print(f"\nA client's round of {args.inner} steps through DPTrainer (N = 1000, expected batch 64, CPU):")
    print(f"{'model':<8}  {'impl':<21}{'ms/step':>10}{'× torch-rng round':>19}")
    for r in rounds:
        print(f"{r['model']:<8}  {r['impl']:<21}{r['ms_per_step']:>10.3f}{r['ratio_vs_torchrng']:>19.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": rows, "rounds": rounds}, f, indent=2)


if __name__ == "__main__":
    main()
