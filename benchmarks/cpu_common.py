"""What the CPU benchmarks against other engines share: the CPU's name and flags, and the ONNX
export of a BERT checkpoint that ONNX Runtime runs (test_cpu_peers.py, lowp_encoder.py)."""
import platform


def cpu_name_and_flags():
    """(model name, set of /proc/cpuinfo flags): the hardware's, whatever CPUID masking a process does"""
    name, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return name, flags


def export_onnx(model_dir, path):
    """transformers' BertModel of model_dir (eager attention, float32) exported to path with
    torch.onnx (opset 17, dynamic batch and sequence axes; inputs input_ids, attention_mask,
    token_type_ids; output last_hidden_state); returns the model's config"""
    import torch
    import transformers
    eager = transformers.BertModel.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()

    class Wrap(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, a, b, c):
            return self.m(input_ids=a, attention_mask=b, token_type_ids=c).last_hidden_state

    x = torch.ones(2, 16, dtype=torch.long)
    axes = {0: "batch", 1: "seq"}
    torch.onnx.export(Wrap(eager), (x, x, torch.zeros_like(x)), path, opset_version=17, dynamo=False,
                      input_names=["input_ids", "attention_mask", "token_type_ids"], output_names=["last_hidden_state"],
                      dynamic_axes={"input_ids": axes, "attention_mask": axes, "token_type_ids": axes,
                                    "last_hidden_state": axes})
    return eager.config
