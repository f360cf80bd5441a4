"""autopar/_util/kv_cache.py: a Hugging Face model's key/value cache, off in training forwards only."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from autopar._util.kv_cache import kv_cache_off_in_training, kv_cache_off_while, remove_kv_cache_hooks  # noqa: E402


def _llama(layers: int = 2):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def test_training_forwards_run_without_the_cache_and_the_rest_keep_it():
    model = _llama()
    reference = model(input_ids=IDS, labels=IDS)
    assert reference.past_key_values is not None  # the default: a training forward builds the cache
    assert kv_cache_off_in_training(model) == ["", "model"]  # the causal LM and its decoder stack
    assert kv_cache_off_in_training(model) == ["", "model"]  # idempotent: one hook each
    out = model(input_ids=IDS, labels=IDS)
    assert out.past_key_values is None and model.config.use_cache is True
    torch.testing.assert_close(out.loss, reference.loss, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, reference.logits, rtol=0, atol=0)
    assert model(input_ids=IDS, use_cache=True).past_key_values is not None  # a call's own choice stays
    model.eval()
    with torch.no_grad():
        assert model(input_ids=IDS).past_key_values is not None  # eval (and generate) keep the cache
    model.train()
    remove_kv_cache_hooks(model)
    assert model(input_ids=IDS).past_key_values is not None


def test_the_trace_s_hooks_go_and_hooks_there_before_stay():
    model = _llama()
    with kv_cache_off_while(model):
        assert model(input_ids=IDS).past_key_values is None
    assert model(input_ids=IDS).past_key_values is not None
    kv_cache_off_in_training(model)
    with kv_cache_off_while(model):
        pass
    assert model(input_ids=IDS).past_key_values is None


def test_a_model_without_a_cache_is_not_hooked():
    assert kv_cache_off_in_training(torch.nn.Linear(2, 2)) == []
    model = _llama()
    model.config.use_cache = False
    assert kv_cache_off_in_training(model) == []


def test_layers_compiled_one_by_one_compile_once_without_the_cache():
    """A layer compiled on its own (per block, as under FSDP) is guarded on its layer's slot of the cache: with the
    cache dynamo compiles it again for every layer (and stops at its recompile limit, 8, leaving the later layers
    eager); without it, once for all."""
    from torch._dynamo.utils import counters

    def graphs(hooked: bool) -> int:
        model = _llama(layers=4)
        if hooked:
            kv_cache_off_in_training(model)
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward, backend="eager")
        torch._dynamo.reset()
        counters.clear()
        for _ in range(2):
            model(input_ids=IDS, labels=IDS).loss.backward()
        return counters["stats"]["unique_graphs"]

    try:
        assert graphs(hooked=True) == 1
        assert graphs(hooked=False) > 1  # the cost this avoids, where this transformers has it (5.24: 4)
    finally:
        torch._dynamo.reset()


def test_wrap_runs_training_without_the_cache_and_says_so():
    import autopar

    model = _llama()
    reference = _llama()(input_ids=IDS, labels=IDS)
    wrapped = autopar.wrap(model, sample={"input_ids": IDS, "labels": IDS}, plan=autopar.Plan(micro_batch_size=2),
                           verbose=False)
    notes = autopar.applied(wrapped).notes
    assert any(n.startswith("training forwards run without the model's key/value cache") for n in notes), notes
    out = wrapped(input_ids=IDS, labels=IDS)
    assert out.past_key_values is None and wrapped.config.use_cache is True
    torch.testing.assert_close(out.loss, reference.loss, rtol=0, atol=0)
    wrapped.eval()
    with torch.no_grad():
        assert wrapped(input_ids=IDS).past_key_values is not None
