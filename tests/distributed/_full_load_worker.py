"""Worker of tests/strategies/test_full_load.py (torchrun, gloo): a tiny Hugging Face Llama wrapped under PLAN from
one seed, then `model.load_state_dict` of another seed's plain (full) state dict, as a pretrained checkpoint loads,
then `save_pretrained` of `autopar.full_state_dict`. Rank 0 writes the gathered full state after the load, the loss
of one batch, full_state_dict's tensors and the saved model reloaded. argv: OUT.pt PLAN-NAME."""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

import autopar
from tests._training import make_model

PLANS = {"fsdp": dict(dp_shard=2, micro_batch_size=2), "replicas": dict(dp_replicate=2, micro_batch_size=2),
         "tp": dict(tp=2, micro_batch_size=4), "fsdp-tp": dict(dp_shard=2, tp=2, micro_batch_size=2)}


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def main(out: str, name: str) -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    plan = autopar.Plan(**PLANS[name])
    model = make_model("llama", seed=1)
    rows = 4 // plan.dp_size
    autopar.wrap(model, sample={k: v[:rows] for k, v in batch().items()}, plan=plan, verbose=False)
    result = model.load_state_dict(make_model("llama", seed=2).state_dict())
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}
    r = autopar.data_shard(model).rank
    local = {k: v[r * rows:(r + 1) * rows] for k, v in batch().items()}
    loss = model(**local).loss.detach().clone()
    dist.all_reduce(loss)
    full = autopar.full_state_dict(model)  # every rank, plain tensors on the CPU
    kept = dict(full)  # (save_pretrained empties the dict it is given as it writes)
    folder = os.path.join(os.path.dirname(out), "pretrained")
    model.save_pretrained(folder, state_dict=full, is_main_process=dist.get_rank() == 0)
    dist.barrier()
    if dist.get_rank() == 0:
        import transformers

        reloaded = transformers.LlamaForCausalLM.from_pretrained(folder).state_dict()
        torch.save({"state": state, "loss": loss.item() / dist.get_world_size(), "result": str(result),
                    "full": kept, "reloaded": reloaded}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
