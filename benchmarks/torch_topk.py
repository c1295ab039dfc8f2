"""The PyTorch + transformers side of the top-k fine-tuning benchmarks (topk_sst2.py, tasks.py):
the same training as fasttran's Trainer(task, train_layers=k) -- the same top k layers of the same
checkpoint (transformers' BertLayer modules), a head with fasttran's initial weights, the same
cached layer-(L-k) states fed as padded batches with an attention mask, the same examples in the
same order per step, torch.optim.AdamW with the same groups (no decay on biases and LayerNorm),
clipping, linear schedule with warmup, and dropout at the same places (drawn from torch's
generator: the one difference). Every task fasttran's heads have: a linear head on mean-pooled
states (classification: cross-entropy; regression: squared error; multi-label: binary
cross-entropy per label) or on every token (token classification: cross-entropy over the labelled
tokens; QA: start and end scores, cross-entropy over each example's context tokens)."""
import os
import time

import numpy as np


def engines(threads):
    """fasttran and torch on `threads` threads each; (MiniLM's directory, its fasttran Encoder)"""
    import fasttran
    import torch
    fasttran.set_num_threads(threads)
    torch.set_num_threads(threads)
    path = fasttran.models.minilm_path()
    return path, fasttran.Encoder.from_pretrained(path)


def out_path(name):
    """benchmarks/<name>, where a script writes its JSON"""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), name)


class TorchTopK:
    """fasttran's Trainer(head, train_layers=k, optimizer="adamw", ...) in PyTorch. `head` is the
    fasttran head the Trainer starts from (its kind, size and initial weights)."""

    def __init__(self, enc_path, k, head, lr, epochs, steps_per_epoch, dropout=0.1, seed=0, weight_decay=0.01,
                 warmup=0.1, max_grad_norm=1.0):
        import torch
        from transformers import BertModel
        torch.manual_seed(seed)
        ref = BertModel.from_pretrained(enc_path, attn_implementation="eager")
        L, C = ref.config.num_hidden_layers, ref.config.hidden_size
        for m in ref.modules():   # the same dropout as fasttran's layers
            if isinstance(m, torch.nn.Dropout):
                m.p = dropout
        self.torch, self.k, self.head, self.C = torch, k, head, C
        self.layers = torch.nn.ModuleList(ref.encoder.layer[L - k:]) if k else torch.nn.ModuleList()
        self.lin = torch.nn.Linear(C, head.num_labels)
        init = head.state_dict()
        prefix = "qa_outputs" if head.task == "qa" else "classifier"
        with torch.no_grad():
            self.lin.weight.copy_(torch.from_numpy(init[f"{prefix}.weight"]))
            self.lin.bias.copy_(torch.from_numpy(init[f"{prefix}.bias"]))
        self.drop = torch.nn.Dropout(dropout)
        named = list(self.layers.named_parameters()) + [("classifier." + n, p) for n, p in self.lin.named_parameters()]
        no_decay = ("bias", "LayerNorm.weight", "LayerNorm.bias")
        groups = [{"params": [p for n, p in named if not any(s in n for s in no_decay)], "weight_decay": weight_decay},
                  {"params": [p for n, p in named if any(s in n for s in no_decay)], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=lr, eps=1e-6, betas=(0.9, 0.999))
        total, warm = steps_per_epoch * epochs, int(warmup * steps_per_epoch * epochs)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: (s + 1) / max(warm, 1) if s < warm else max(0.0, (total - s) / max(total - warm, 1)))
        self.params = [p for _, p in named]
        self.max_grad_norm = max_grad_norm

    def _states(self, source, ids):
        """(token states (B, T, C) after the trained layers, mask (B, T)) or pooled features (B, C)"""
        torch = self.torch
        if not self.k and source.positions != "all":
            return torch.from_numpy(np.ascontiguousarray(source.get(ids))), None
        x, offsets = source.get(ids, ragged=True)
        lengths = np.diff(offsets)
        T = int(lengths.max())
        pad = np.zeros((len(lengths), T, self.C), np.float32)
        mask = np.arange(T)[None, :] < lengths[:, None]
        pad[mask] = x
        h, m = torch.from_numpy(pad), torch.from_numpy(mask)
        ext = (1.0 - m[:, None, None, :].float()) * torch.finfo(torch.float32).min
        for layer in self.layers:
            o = layer(h, attention_mask=ext)
            h = o[0] if isinstance(o, tuple) else o
        return h, m

    def _logits(self, source, ids, training):
        h, m = self._states(source, ids)
        if self.head.takes_tokens:
            return self.lin(self.drop(h) if training else h), m
        if m is not None:
            mf = m[..., None].float()
            h = (h * mf).sum(1) / mf.sum(1)
        return self.lin(self.drop(h) if training else h), None

    def _loss(self, logits, mask, targets, valid=None):
        F = self.torch.nn.functional
        t = self.torch.from_numpy(np.asarray(targets))
        if self.head.task == "qa":   # (B, T, 2); the softmax over each example's context tokens
            ctx = self.torch.zeros(mask.shape, dtype=self.torch.bool)
            ctx[mask] = self.torch.from_numpy(np.asarray(valid) > 0)
            z = logits.masked_fill(~ctx[..., None], float("-inf"))
            return (F.cross_entropy(z[..., 0], t[0].long()) + F.cross_entropy(z[..., 1], t[1].long())) / 2
        if self.head.task == "classification":
            return F.cross_entropy(logits, t.long())
        if self.head.task == "regression":
            return F.mse_loss(logits, t.float().reshape(logits.shape))
        if self.head.task == "multi-label":
            return F.binary_cross_entropy_with_logits(logits, t.float())
        # tokens: the flat labels of the real rows, -1 = none
        return F.cross_entropy(logits[mask], t.long(), ignore_index=-1)

    def train_epoch(self, cache, prep, order, batch_size=32):
        """one epoch over `order` (example positions); returns its seconds"""
        for mod in (self.layers, self.lin, self.drop):
            mod.train()
        t0 = time.perf_counter()
        for a in range(0, len(order), batch_size):
            idx = order[a:a + batch_size]
            ids = cache.example_ids[idx]
            lengths = np.asarray(cache.lengths)[idx]
            targets, valid = self.head.batch(prep, idx, lengths)
            logits, mask = self._logits(cache, ids, True)
            loss = self._loss(logits, mask, targets, valid)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
            self.opt.step()
            self.sched.step()
        return time.perf_counter() - t0

    def outputs(self, source, batch_size=256):
        """the head's outputs over `source` (as fasttran's Trainer._outputs gives them)"""
        for mod in (self.layers, self.lin, self.drop):
            mod.eval()
        prep = self.head.prepare_eval(source, None)
        chunks = []
        with self.torch.no_grad():
            for a in range(0, len(source), batch_size):
                ids = source.example_ids[a:a + batch_size]
                logits, mask = self._logits(source, ids, False)
                if mask is None:
                    chunks.append(logits.numpy())
                    continue
                lengths = mask.sum(1).numpy()
                if self.head.task == "qa":   # (2, N) over the real rows, as fasttran's model gives them
                    _, valid = self.head.batch(prep, np.arange(a, a + len(ids)), lengths)
                    chunks.append(self.head.outputs(logits[mask].T.numpy(), lengths, valid))
                else:
                    chunks.append([logits[b, :n].numpy() for b, n in enumerate(lengths)])
        return self.head.collect(chunks)
