"""One real GRPO job (TRL's ``GRPOTrainer``), alone or time-sliced: the child of ``make demo-rl``.

    python -m timeslice_tools.dev.rl.job --job-id grpo-a --seed 1 --steps 40 \\
        --work DIR --out grpo-a.json [--group G --agent-socket S] [--corrupt-step N]

Everything is built in code (nothing is downloaded): a character-level tokenizer over
``0-9 + =``, a 2-layer Llama-architecture policy from a config (saved to ``--work``, because
TRL loads the policy and its reference model from a path), and prompts ``a+b=`` whose reward
is 1 for the right sum (0.2 for any digit). GRPO proper: groups of 4 completions per prompt,
group-relative advantages, clipped policy loss, KL to the reference policy (``beta=0.04``).

Determinism: one thread, deterministic algorithms, fixed seeds, so a run alone is repeatable
to the bit. With ``--group``, the trainer is time-sliced through
:func:`timeslice.integrations.trl.time_slice` (generation and training phases each hold the
group; the policy, the reference model and the optimizer state move through the node agent's
``app`` backend at every switch). The output JSON has, per optimizer step, the loss, reward
and KL as logged, and a SHA-256 of every parameter after the step; and the holds.

``--corrupt-step N`` (a test switch, time-sliced only) flips one bit of the first parameter
right after the grant of step N's training phase, as a restore gone wrong would: the demo must
then report that step and tensor.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

PROMPTS = 64
BARRIER_SECONDS = 300.0
VOCAB = ["<pad>", "<eos>", "<bos>", *"0123456789+="]


def _deterministic() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def build(seed: int, work: Path) -> tuple[Path, Any, Any]:
    """Save a tiny policy and its tokenizer under ``work``; returns the path, the tokenizer
    and the training set."""
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<pad>"))
    word_level.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=word_level, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    tokenizer.padding_side = "left"
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    path = work / "policy"
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(PROMPTS)]
    data = Dataset.from_dict(
        {"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]}
    )
    return path, tokenizer, data


def arithmetic_reward(completions: list[str], answer: list[str], **_: Any) -> list[float | None]:
    """1 for the right sum, 0.2 for an answer that at least starts with a digit, else 0."""
    rewards: list[float | None] = []
    for completion, right in zip(completions, answer, strict=True):
        text = completion.replace(" ", "")
        rewards.append(1.0 if text.startswith(right) else 0.2 if text[:1].isdigit() else 0.0)
    return rewards


def digests(model: Any) -> dict[str, str]:
    """SHA-256 of every parameter's bytes, by name."""
    import torch

    out = {}
    for name, param in model.named_parameters():
        # Through a copy: a storage numpy has seen can no longer be resized, so offloaded.
        data = param.detach().clone().view(-1).view(dtype=torch.uint8)
        out[name] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    _deterministic()
    import torch
    from transformers import TrainerCallback
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    args.work.mkdir(parents=True, exist_ok=True)
    path, tokenizer, data = build(args.seed, args.work)
    config = GRPOConfig(
        output_dir=str(args.work / "trainer"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=3,
        max_steps=args.steps,
        learning_rate=3e-3,
        beta=0.04,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=str(path),
        reward_funcs=[arithmetic_reward],
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
    )
    # On the CPU, from_pretrained maps the safetensors file: storages that can not be freed
    # and re-allocated, which the offloader refuses. A copy of their own (alone too, so both
    # runs are the same program); on a GPU, moving the model to the device does this.
    for module in (trainer.model, getattr(trainer, "ref_model", None)):
        if module is not None:
            for param in module.parameters():
                param.data = param.data.clone()
    policy = trainer.model
    assert policy is not None
    steps: list[dict[str, Any]] = []

    class Record(TrainerCallback):
        # Added before time_slice's callback: it reads the parameters while still held.
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            steps.append({"step": state.global_step, "params": digests(trainer.model)})

        def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            logs = kwargs.get("logs")
            if logs and "loss" in logs and steps and steps[-1]["step"] == state.global_step:
                for key in ("loss", "reward", "kl"):
                    steps[-1][key] = logs.get(key)

    trainer.add_callback(Record())
    if args.barrier is not None:
        _wait_for_go(args.barrier, args.job_id)
    started = time.time()
    if args.group is None:
        trainer.train()
        final = digests(trainer.model)
        holds: list[dict[str, Any]] = []
        job_bytes = 0
        parked = []
    else:
        from timeslice import TimeSliceOrchestratorClient
        from timeslice.integrations.trl import time_slice
        from timeslice.offload import TorchOffloader

        def corrupt(phase: str, grant: Any) -> None:
            if phase == "training" and trainer.state.global_step + 1 == args.corrupt_step:
                first = next(iter(policy.parameters()))
                with torch.no_grad():
                    first.view(-1)[:1].view(torch.int32).bitwise_xor_(1)
                print(f"corrupted one bit of the first parameter at step {args.corrupt_step}")

        class CheckedOffloader(TorchOffloader):
            """Records, at every offload the agent asks for, whether every tracked storage
            (policy, reference, optimizer state) was really freed: size 0 while parked."""

            parked: list[bool] = []

            def offload(self, tags: Any = None) -> int:
                copied = super().offload(tags)
                self.parked.append(self.device_bytes == 0)
                return copied

        os.environ["TIMESLICE_AGENT_SOCKET"] = str(args.agent_socket)
        offloader = CheckedOffloader()
        with (
            TimeSliceOrchestratorClient(job_id=args.job_id) as client,
            time_slice(
                trainer,
                client,
                args.group,
                offloader=offloader,
                timeout=120.0,
                on_grant=corrupt if args.corrupt_step else None,
            ) as sliced,
        ):
            trainer.train()
            with sliced.hold():
                final = digests(trainer.model)
                job_bytes = offloader.device_bytes
            holds = [asdict(h) for h in sliced.holds]
        parked = offloader.parked
    return {
        "job": args.job_id,
        "mode": "alone" if args.group is None else "time-sliced",
        "seconds": time.time() - started,
        "state_bytes": job_bytes,
        "steps": steps,
        "final": final,
        "holds": holds,
        "parked_at_size_zero": parked,
    }


def _wait_for_go(barrier: Path, job: str) -> None:
    """Say this job is ready, then wait for the demo's go: jobs that import and build at
    different speeds still train at the same time, so their phases really interleave."""
    (barrier / f"{job}.ready").touch()
    deadline = time.monotonic() + BARRIER_SECONDS
    while not (barrier / "go").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no go from the demo within {BARRIER_SECONDS:.0f} s")
        time.sleep(0.02)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m timeslice_tools.dev.rl.job", description=__doc__)
    p.add_argument("--job-id", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--group", help="time-slice on this group (default: run alone)")
    p.add_argument("--agent-socket", type=Path)
    p.add_argument("--corrupt-step", type=int, default=0)
    p.add_argument("--barrier", type=Path, help="write JOB.ready here, start on a file 'go'")
    args = p.parse_args(argv)
    if args.group is not None and args.agent_socket is None:
        p.error("--group needs --agent-socket")
    if args.corrupt_step and args.group is None:
        p.error("--corrupt-step only applies time-sliced")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = run(args)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(args.out)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
