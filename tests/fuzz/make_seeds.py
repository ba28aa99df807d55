#!/usr/bin/env python3
# tests/fuzz/make_seeds.py - writes the seed corpora of the fuzz targets under seeds/<target>/:
# small valid inputs of every shape the readers accept, and a few near misses. libFuzzer mutates
# from these; the committed files are what this script writes (run it from any folder).
import json, os, struct

HERE = os.path.dirname(os.path.abspath(__file__))


def put(target, name, data):
    d = os.path.join(HERE, "seeds", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def tokens(count, values, tail=b""):
    return b"LLTOKENS" + struct.pack("<IIQ", 1, 4, count) + struct.pack(f"<{len(values)}I", *values) + tail


put("tokens", "valid", tokens(5, [1, 2, 3, 500, 7]))
put("tokens", "empty", tokens(0, []))
put("tokens", "trailing_bytes", tokens(2, [4, 5], b"\0\0"))
put("tokens", "outside_vocabulary", tokens(3, [1, 600, 2]))
put("tokens", "truncated", tokens(4, [1, 2]))
put("tokens", "version_3", b"LLTOKENS" + struct.pack("<IIQ", 3, 4, 0))


def tokens2(values, starts, tail=b"", count=None, docs=None):
    n = len(values) if count is None else count
    m = len(starts) if docs is None else docs
    return (b"LLTOKENS" + struct.pack("<IIQQ", 2, 4, n, m) + struct.pack(f"<{len(values)}I", *values) +
            struct.pack(f"<{len(starts)}Q", *starts) + tail)


put("tokens", "v2_valid", tokens2([1, 2, 3, 500, 7, 8], [0, 2, 5]))
put("tokens", "v2_one_document", tokens2([9, 9, 9], [0]))
put("tokens", "v2_one_token_documents", tokens2([1, 2, 3], [0, 1, 2]))
put("tokens", "v2_empty", tokens2([], []))
put("tokens", "v2_not_ascending", tokens2([1, 2, 3, 4], [0, 3, 2]))
put("tokens", "v2_first_not_zero", tokens2([1, 2, 3], [1]))
put("tokens", "v2_start_past_end", tokens2([1, 2, 3], [0, 3]))
put("tokens", "v2_trailing_bytes", tokens2([1, 2], [0], b"\0\0\0\0"))
put("tokens", "v2_truncated", tokens2([1, 2], [0], docs=2))
put("tokens", "v2_no_documents", tokens2([1, 2], []))


def safetensors(tensors, metadata=None, pad=True, extra=b""):
    header, offset, data = {}, 0, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        n = {"F32": 4, "BF16": 2, "F16": 2}.get(dtype, 1)
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        data += bytes(range(n % 251)) + bytes(n - n % 251)
        offset += n
    text = json.dumps(header)
    if pad:
        text += " " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text.encode() + data + extra


three = [("model.norm.weight", "F32", [4]), ("model.embed_tokens.weight", "BF16", [3, 2]), ("w", "F16", [2, 1, 2])]
put("safetensors", "valid", safetensors(three, {"format": "pt"}))
put("safetensors", "unpadded", safetensors(three, pad=False))
put("safetensors", "empty_tensor", safetensors([("a", "F32", [0, 5]), ("b", "F32", [1])]))
put("safetensors", "scalar", safetensors([("s", "F32", [])], {"note": "caf\u00e9 \ud83d\ude00"}))
put("safetensors", "no_tensors", safetensors([], {}))
put("safetensors", "trailing_byte", safetensors(three, extra=b"\0"))
put("safetensors", "dtype_i8", safetensors([("q", "I8", [4])]))

rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}
tiny = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 512, "rms_norm_eps": 1e-05, "tie_word_embeddings": True, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16"}
put("config", "v4", json.dumps(dict(tiny, rope_theta=500000.0, rope_scaling=rope), indent=2))
put("config", "v5", json.dumps(dict(tiny, rope_parameters=dict(rope, rope_theta=500000.0))))
put("config", "both_places", json.dumps(dict(tiny, rope_theta=500000, rope_scaling=rope,
                                             rope_parameters=dict(rope, rope_theta=5e5))))
old = {k: v for k, v in rope.items() if k != "rope_type"}
put("config", "type_spelling", json.dumps(dict(tiny, rope_theta=500000.0, rope_scaling=dict(old, type="llama3"))))
bare = {k: v for k, v in tiny.items() if k not in ("hidden_act", "attention_bias", "mlp_bias", "architectures")}
put("config", "defaults", json.dumps(dict(bare, rope_theta=500000.0, rope_scaling=rope), separators=(",", ":")))
put("config", "escapes", '{"model_type": "ll\\u0061ma", "name": "\\ud83d\\ude00 caf\u00e9 \\/\\b\\f\\n\\r\\t\\"\\\\"}')
put("config", "wrong_types", json.dumps(dict(tiny, hidden_size="128", tie_word_embeddings="true", rope_theta=None)))

put("index", "valid", json.dumps({"metadata": {"total_size": 1234},
                                  "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors",
                                                 "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                                 "lm_head.weight": "model-00002-of-00002.safetensors"}}, indent=2))
put("index", "one_shard", '{"weight_map":{"a":"model.safetensors"}}')
put("index", "unicode", '{"weight_map": {"t\\u00e9": "sh\u00e4rd.safetensors", "u": "x\\u0041.safetensors"}}')
put("index", "path", '{"weight_map": {"a": "../model.safetensors"}}')


# outputs: a tree, then the paths of flags. Entries (name, target, kind) and paths (use, name,
# flag, spelling) are indexes into fuzz_outputs.cpp's tables: names a b c d d/x d/y d/e d/e/z
# step-1 step-1/r and one of 300 bytes; kinds file, folder, link (absolute, relative), hard
# link, FIFO, socket, loop; uses read, write a file, write into a folder, clear a folder; flags
# --log --dump --data --save-to --state-dir --eval-data; spellings as is, ./, //, d/../, a
# trailing slash, /., relative, over PATH_MAX.
def outputs(entries, paths):
    return bytes([len(entries)] + [b for e in entries for b in e] + [len(paths) - 1] + [b for p in paths for b in p])


put("outputs", "log_over_data", outputs([(0, 0, 0)], [(0, 0, 2, 0), (1, 0, 0, 1)]))
put("outputs", "hard_link", outputs([(0, 0, 0), (1, 0, 4)], [(0, 0, 2, 0), (1, 1, 1, 0)]))
put("outputs", "dangling", outputs([(0, 1, 2)], [(1, 0, 0, 0), (2, 0, 3, 0)]))
put("outputs", "cleared", outputs([(8, 0, 1), (9, 0, 0)], [(3, 8, 4, 0), (0, 9, 2, 0), (1, 9, 0, 2)]))
put("outputs", "kinds", outputs([(3, 0, 1), (4, 0, 5), (5, 0, 6), (6, 0, 7)], [(1, 4, 0, 0), (2, 5, 3, 0), (1, 3, 1, 4), (1, 6, 5, 3)]))
put("outputs", "long", outputs([], [(1, 10, 0, 0), (2, 0, 3, 7)]))
put("outputs", "new_names", outputs([(3, 0, 1)], [(1, 1, 0, 0), (1, 1, 1, 6), (0, 2, 2, 3)]))
# What the target found while it was written: a dangling link read inside a cleared folder, a
# link read that points where a new output will be, a dangling link given as a folder with '/'.
put("outputs", "dangling_in_cleared", outputs([(8, 0, 1), (9, 0, 3)], [(3, 8, 4, 0), (0, 9, 2, 0), (1, 9, 0, 2)]))
put("outputs", "link_to_new_output", outputs([(0, 1, 2)], [(1, 1, 0, 0), (0, 10, 0, 4), (0, 0, 2, 0), (3, 0, 0, 0)]))
put("outputs", "dangling_folder_slash", outputs([(8, 0, 0), (0, 1, 2)], [(3, 0, 0, 4), (2, 0, 3, 4)]))
# And where the oracle was wrong, found by `make test`: a folder to clear that was no folder
# until a file was made where a link pointed, and a link to a folder given with a trailing slash.
put("outputs", "cleared_made_later", bytes.fromhex("040300020800010900000203080400000902000109000201040007000600000605000104050001b800"))
put("outputs", "link_with_slash", bytes.fromhex("02424a4a4a4a010900030004030031042b040404040402030804043131313131313131313131"))
