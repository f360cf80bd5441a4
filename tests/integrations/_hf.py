"""What the Hugging Face Trainer tests share, in the test process and in the torchrun worker: a tiny Llama built
from its config (no download), a dataset of token rows that records which rows each process read, the
TrainingArguments, and a run of the Trainer that returns its per-step losses and the rows of every step."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

STEPS = 10
GLOBAL = 8  # samples per optimizer step over all processes
SEQ = 16
VOCAB = 128
ROWS = 96  # more than STEPS x the largest global batch (8): one epoch, no rows reused


def make_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


class Rows(torch.utils.data.Dataset):
    """Distinct token rows, each with its labels and a column the model does not take (`remove_unused_columns`
    drops it, by the forward's signature)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        self.index = {tuple(r.tolist()): i for i, r in enumerate(self.ids)}
        assert len(self.index) == ROWS

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i], "source": torch.tensor(i)}


def sample(n: int) -> dict:
    ids = Rows().ids[:n]
    return {"input_ids": ids, "labels": ids}


def args(out: str, *, per_device: int, accum: int = 1, **kw) -> TrainingArguments:
    base = dict(output_dir=out, max_steps=STEPS, per_device_train_batch_size=per_device,
                gradient_accumulation_steps=accum, learning_rate=1e-3, lr_scheduler_type="constant",
                logging_steps=1, report_to=[], save_strategy="no", seed=0, use_cpu=True, disable_tqdm=True,
                dataloader_drop_last=True)
    base.update(kw)
    return TrainingArguments(**base)


class RecordRows(TrainerCallback):
    """Which dataset rows (found by their tokens) each optimizer step's forwards got on this process, and the
    columns the model was called with (the Trainer removes those the forward's signature does not name)."""

    def __init__(self, model, dataset: Rows) -> None:
        self.dataset, self.steps, self.columns = dataset, [[]], []
        model.register_forward_pre_hook(self.forward_called, with_kwargs=True)

    def forward_called(self, module, args, kwargs):
        self.columns = sorted(kwargs)
        if module.training:
            self.steps[-1].extend(self.dataset.index[tuple(r.tolist())] for r in kwargs["input_ids"])

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append([])


class StopAt(TrainerCallback):
    """Ends the run after step `step` (its checkpoint saved), as a job killed there would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def train(model, training_args: TrainingArguments, callbacks=(), resume_from_checkpoint=None) -> dict:
    """Run the Trainer; return the per-step losses (logged, so averaged over ranks; a resumed run's history holds
    those before its checkpoint) and the rows of each step this run trained."""
    dataset = Rows()
    rows = RecordRows(model, dataset)
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=[rows, *callbacks])
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"losses": losses, "rows": rows.steps[:-1], "columns": rows.columns}  # (the last: after the last step)
