# Investigation script for the GGUF chat problem; findings in docs/deploy.md section 6.
"""Reproduce SGLang's GGUF path on CPU: raw GGUF Q/K weights (llama.cpp-permuted) + neox RoPE."""
import glob, torch, gguf, numpy as np
from transformers import AutoModelForCausalLM, AutoTokenizer
from oscar_sglang.tools.models import embedded_gguf_path
hf = glob.glob('/root/.cache/oscar-sglang/hf-from-gguf/SmolLM2*')[0]
tok = AutoTokenizer.from_pretrained(hf)
lm = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
r = gguf.GGUFReader(str(embedded_gguf_path()))
raw = {}
for t in r.tensors:
    if '.attn_q.' in t.name or '.attn_k.' in t.name:
        raw[t.name] = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
L0 = lm.model.layers[0].self_attn
print('hf q == reverse(gguf q)?', torch.allclose(permute(L0.q_proj.weight, 9), raw['blk.0.attn_q.weight'], atol=1e-5),
      '| hf q == gguf q raw?', torch.allclose(L0.q_proj.weight, raw['blk.0.attn_q.weight'], atol=1e-5))
print('hf k == reverse(gguf k)?', torch.allclose(permute(L0.k_proj.weight, 3), raw['blk.0.attn_k.weight'], atol=1e-5))
chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True)
prompts = {"plain": "The capital of France is", "chat": chat}
def gen(tag):
    for name, p in prompts.items():
        ids = tok(p, return_tensors='pt').input_ids
        out = lm.generate(ids, max_new_tokens=12, do_sample=False)
        new = out[0, ids.shape[1]:].tolist()
        print(f'[{tag}] {name} ({ids.shape[1]} prompt tokens): ids={new} text={tok.decode(new)!r}')
gen('transformers (HF layout, neox rope)')
with torch.no_grad():
    for i, layer in enumerate(lm.model.layers):
        layer.self_attn.q_proj.weight.copy_(raw[f'blk.{i}.attn_q.weight'])
        layer.self_attn.k_proj.weight.copy_(raw[f'blk.{i}.attn_k.weight'])
gen('GGUF raw Q/K + neox rope = SGLang GGUF path')
# what SGLang would emit with ignore_eos: continue past <|im_end|>
ids = tok(chat, return_tensors='pt').input_ids
out = lm.generate(ids, max_new_tokens=10, do_sample=False, suppress_tokens=None, eos_token_id=None, min_new_tokens=10)
print('[GGUF raw + neox] chat, eos ignored:', out[0, ids.shape[1]:].tolist())
# the fix: same raw GGUF Q/K weights, GPT-J (interleaved) RoPE = config rope_is_neox_style=false in SGLang
import transformers.models.llama.modeling_llama as ml
def interleaved(q, k, cos, sin, unsqueeze_dim=1):
    d = q.shape[-1]
    c = cos[..., : d // 2].repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)
    s = sin[..., : d // 2].repeat_interleave(2, -1).unsqueeze(unsqueeze_dim)
    rot = lambda x: torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
    return q * c + rot(q) * s, k * c + rot(k) * s
ml.apply_rotary_pos_emb = interleaved
gen('GGUF raw Q/K + interleaved rope (rope_is_neox_style=false)')
