"""The torch adapter: a map-style torch Dataset over an ActivationCache, reading whole
batches at once (DataLoader's __getitems__ protocol). torch is imported only here."""
import numpy as np

from ..errors import InputError


class CacheDataset:
    """torch map-style dataset over an ActivationCache; items are (features, label)."""

    def __init__(self, cache, labels=None):
        import torch  # noqa: F401  (only needed here)
        self.cache = cache
        self.labels = None if labels is None else np.asarray(labels)
        if self.labels is not None and len(self.labels) != len(cache):
            raise InputError(f"labels has {len(self.labels)} entries, the cache {len(cache)} examples")

    def __len__(self):
        return len(self.cache)

    def __getitems__(self, indices):
        import torch
        idx = np.asarray(indices, np.int64)
        x = self.cache.get(self.cache.example_ids[idx])
        feats = torch.from_numpy(x) if not isinstance(x, tuple) else tuple(torch.from_numpy(a) for a in x)
        if self.labels is None:
            return feats
        return feats, torch.from_numpy(self.labels[idx])

    def __getitem__(self, i):
        return self.__getitems__([i])

    @staticmethod
    def collate(batch):
        return batch
