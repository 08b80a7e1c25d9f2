"""
The loader: Energon-compatible tar shards -> fixed-shape batches, in a deterministic order that resumes exactly
(the tokenizer and chat templates: chat.py; pixels: images.py; tars and .nv-meta: shards.py; writing shards: pack.py).
A sample is KEY.jpg (image), KEY.txt (first answer) and KEY.json ({"question", "conversations", "id"}),
the layout of Megatron-Energon's VQA datasets; several images are KEY.0.jpg, KEY.1.png... (tag order), a video's
frames KEY.f0.jpg, KEY.f1.jpg...
"""

import itertools
import json
import os
import re

import numpy as np
import torch

import storage
from chat import (IMAGE_TAG, IMAGE_TAG_RE, TAGS_RE, VIDEO_TAG, DropSample, Tokenizer, check_template,
                  conversation_problem, encode_conversation, encode_preference, generation_prompt, place_image_tags,
                  tokenize)
from images import CLIP_MEAN, image_hw, image_tiles, load_image
from mixture import Mixture, Source
from shards import ShardReader, Skips, log

NUMBERED_IMAGE_RE = re.compile(r"(f?)(\d+)\.(?:jpg|jpeg|png|webp)")  # KEY.0.jpg: image 0 of several; KEY.f0.jpg: frame 0
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
STORAGE_ERROR = "storage_error"  # the key of the one-entry "batch" that carries a DataLoader worker's StorageError
# why a sample dropped, as a batch's drop_reason codes carry it (1 + index; 0: not dropped): a fixed table, so that
# every rank's counts by source and reason add up in one collective. The first word of a DropSample's sentence
DROP_REASONS = ("no_room_in_pack", "too_many_tiles", "multi_needs_max_tiles", "video_needs_max_tiles",
                "image_beyond_seq_len", "answer_beyond_seq_len", "no_supervised_tokens", "image_tag_count_mismatch",
                "image_tag_mismatch", "plain_template_without_image", "video_without_video_token",
                "not_a_preference_pair", "image_and_video", "unreadable_sample", "malformed_conversations",
                "unknown_role", "non_text_value", "invalid_unicode", "no_gpt_turn", "empty_answer",
                "skip_steps", "nonfinite_update", "other")
# skip_steps: read by a step that trains nothing (train.py's skip_steps); nonfinite_update: by a step whose update was
# skipped (a non-finite loss or gradient). Kept by name in a checkpoint: a reason may be added before "other".


# -----------------------------------------------------------------------------
# reading shards: an index of samples, a deterministic order, exact resume (tars and .nv-meta: shards.py)


CAPTION_KEYS = ("caption", "answer", "text", "captions", "answers")  # where webdatasets keep a caption in KEY.json


def sample_conversation(members):
    """(conversation, image bytes or None) from our members, or from a plain webdataset jpg/png + json/txt; images
    without a tag get theirs as pack gives them (place_image_tags)."""
    image = next((members[e] for e in IMAGE_EXTS if e in members), None)
    meta = json.loads(members["json"]) if "json" in members else {}
    if "conversations" in meta:
        conv = meta["conversations"]
    else:
        answer = members["txt"].decode() if "txt" in members else ""
        if not answer:  # a caption kept only in KEY.json
            found = [v[0] if isinstance(v, list) and v else v for v in map(meta.get, CAPTION_KEYS)]
            answer = next((v for v in found if isinstance(v, str)), "")
        question = meta.get("question") or meta.get("context") or ""
        conv = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    try:
        kind, blobs = sample_images(members)
    except DropSample:  # images and frames: the loader drops it by its own sample_images call
        return conv, image
    if not blobs or conversation_problem(conv):
        return conv, image
    return place_image_tags(conv, VIDEO_TAG if kind == "video" else IMAGE_TAG, len(blobs) if kind == "multi" else 1), \
        image


def sample_images(members):
    """("image" | "multi" | "video", [image bytes]) of a sample's members: KEY.jpg alone, KEY.0.jpg, KEY.1.png...
    (several, in tag order), KEY.f0.jpg, KEY.f1.jpg... (a video's frames). No image: ("image", [])."""
    numbered = sorted((m[1] == "f", int(m[2]), ext) for ext in members if (m := NUMBERED_IMAGE_RE.fullmatch(ext)))
    single = [members[e] for e in IMAGE_EXTS if e in members][:1]
    frames = [members[ext] for is_frame, _, ext in numbered if is_frame]
    several = [members[ext] for is_frame, _, ext in numbered if not is_frame]
    if sum(map(bool, (single, frames, several))) > 1:
        raise DropSample("image_and_video (in the sample's members)")
    if frames:
        return "video", frames
    return ("multi" if len(several) > 1 else "image"), several or single


def image_layouts(vlm, kind, sizes):
    """anyres.image_layout of each image of a sample, kind and (height, width) sizes as sample_images / image_hw give
    them; a video is one layout over all its frames."""
    from anyres import image_layout

    if kind == "video":
        return [image_layout(vlm, *(sizes[0] if sizes else (0, 0)), "video", len(sizes))]  # no frames: its ValueError
    return [image_layout(vlm, h, w, kind) for h, w in sizes]


def sample_tiles(vlm, kind, blobs, image_mode="pad", mean=None):
    """(n_tiles, 3, S, S) uint8: the tiles of a sample's images in order (images.image_tiles), None for none."""
    return torch.cat([image_tiles(b, vlm, kind, image_mode, mean) for b in blobs]) if blobs else None


def tiled_prompt(vlm, template, tok, question, blobs, kind=None, image_mode="pad", mean=None):
    """(ids, tiles, layouts) of a generation prompt asking `question` about image bytes `blobs` with a tiling model:
    what the tiled loader makes of such a sample. kind: "image" (one), "multi" (several, one <image> each), "video"
    (frames, one <video>); by default "image" or "multi" by count. Tags are put first unless the question has them."""
    kind = kind or ("multi" if len(blobs) > 1 else "image")
    if kind == "video" and vlm.video_token_id is None:
        raise ValueError("this model has no <video> token (video_token_id is None): ask about the frames as images")
    tag = VIDEO_TAG if kind == "video" else IMAGE_TAG
    n_tags = len(blobs) if kind == "multi" else 1 if blobs else 0
    if blobs and tag not in question:
        question = (tag + "\n") * n_tags + question
    layouts = image_layouts(vlm, kind, [image_hw(b) for b in blobs])
    counts = [len(index) for _, index, _ in layouts]
    pieces = [(generation_prompt(template, question, tok), False)]
    n_found = sum(len((TAGS_RE if vlm.video_token_id is not None else IMAGE_TAG_RE).findall(t)) for t, _ in pieces)
    if n_found != len(counts):
        raise ValueError(f"the prompt has {n_found} image/video tags for {len(counts)} {kind} inputs")
    ids, _ = tokenize(pieces, tok, vlm.image_token_id, counts, vlm.video_token_id)
    return ids, sample_tiles(vlm, kind, blobs, image_mode, mean), layouts


class ShardStream(torch.utils.data.IterableDataset):
    """An endless stream of fixed-shape batches from shards, the same for any number of DataLoader workers.

    Epoch e visits every sample once in a deterministic order: the shards shuffled by (seed, e), then
    each block of `shuffle_block` consecutive samples shuffled, so reads stay mostly sequential. The epochs
    follow each other in one global sequence; rank r of W takes its positions r, r + W, r + 2W, ... Batch k of
    a rank is samples [k*N, (k+1)*N) of its stream (N = B, or pack x B when packing), so global batch k is the
    global positions [k*N*W, (k+1)*N*W) whatever W is: a resume on another world size with the same global batch
    continues the same sample order (Loader.load_state_dict). Batch k is built by worker k % n_workers; the
    DataLoader hands batches back in k order, so a resume needs only the position: no replay."""

    def __init__(self, paths, tokenizer, batch_size, seq_len, image_size, image_token_id, n_image_tokens,
                 template="plain", image_mode="pad", split="train", seed=0, rank=0, world_size=1, shuffle_block=1000,
                 pack=0, fast_images=False, image_mean=CLIP_MEAN, vlm=None, max_tiles=0, preference=False, group=0,
                 resample=3):
        if not isinstance(max_tiles, int) or max_tiles < 0:
            raise ValueError(f"ShardStream: max_tiles must be an integer >= 0 (tile slots a row), got {max_tiles!r}")
        if max_tiles and vlm is None:
            raise ValueError("ShardStream: max_tiles > 0 (tile slots) needs the model config: pass vlm=VLMConfig")
        # max_tiles > 0: each row holds max_tiles tile slots; images are tiled and placed by vlm (encode_tiled)
        self.vlm, self.max_tiles = vlm, max_tiles
        if preference and pack:
            raise ValueError("ShardStream: preference pairs (DPO) are read one pair a row pair: pack must be 0")
        self.preference = preference  # batches of 2B rows [chosen..., rejected...], one image a pair (pair_batch)
        # group > 0: every `group` global positions (a step's samples) of one modality, LLaVA-NeXT's
        # group_by_modality_length; longest first only unpacked (packed, long samples together would not fit)
        self.group = group if split == "train" else 0
        self.mixture = Mixture(paths, split, seed, shuffle_block, self.group, by_length=not pack)
        self.files, self.index = self.mixture.files, self.mixture.index
        self.tok = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)
        check_template(template, self.tok)
        self.batch_size, self.seq_len, self.image_size = batch_size, seq_len, image_size
        # pack > 0: a batch reads pack x batch_size samples and packs them into its rows (packed_batch)
        self.pack, self.samples_per_batch = pack, batch_size * pack if pack else batch_size
        self.image_token_id, self.n_image_tokens = image_token_id, n_image_tokens
        self.template, self.image_mode, self.split, self.fast_images = template, image_mode, split, fast_images
        self.image_mean = image_mean  # the pad colour: the tower's mean
        self.resample = resample  # the tower's resize filter (ViTConfig.resample)
        self.seed, self.rank, self.world_size, self.shuffle_block = seed, rank, world_size, shuffle_block
        self.start = 0  # sample position in this rank's stream; set by Loader
        self.origin = 0  # the global position where the mixture's position 0 lies: a changed mixture restarted there
        self.skips = Skips()
        self.reader = ShardReader(self.files, self.index)  # plain reads from a disk, ranged requests from a bucket

    def __len__(self):
        return len(self.index)

    def order(self, epoch):
        """The first source's samples in the order of its pass `epoch` (a lone dataset's epoch)."""
        return self.mixture.orders[0].order(epoch)

    def sample_at(self, position):
        """The sample index at `position` of this rank's stream: global position position * W + rank."""
        return self.mixture.sample_at(position * self.world_size + self.rank - self.origin)

    def read(self, sample):
        """(key, {ext: bytes}) of one sample."""
        return self.reader.read(sample)

    def read_conversation(self, sample):
        """(where, conversation, kind, image bytes) of a sample both encoders share; DropSample if its tar, JSON or
        conversation cannot be trained on."""
        try:
            key, members = self.read(sample)
            conv, _ = sample_conversation(members)
            kind, blobs = sample_images(members)
            problem = conversation_problem(conv)
        except (DropSample, storage.StorageError):  # a bucket that stays unreachable stops training, drops nothing
            raise
        except Exception as e:  # noqa: BLE001  corrupt tar or JSON in a foreign shard
            raise DropSample(f"unreadable_sample ({type(e).__name__}: {e})") from None
        if problem:
            raise DropSample(f"{problem} (in the sample's conversation)")
        return f"{storage.name(self.files[self.index[sample][0]])}:{key}", conv, kind, blobs

    def encode(self, sample):
        if self.max_tiles:
            return self.encode_tiled(sample)
        where, conv, kind, blobs = self.read_conversation(sample)
        if len(blobs) > 1 or kind == "video":  # a one-frame video too: its tag is <video>
            raise DropSample(f"{kind}_needs_max_tiles ({len(blobs)} {'frames' if kind == 'video' else 'images'}: "
                             "set max_tiles > 0)")
        try:
            pixels = load_image(blobs[0], self.image_size, self.image_mode, self.fast_images, self.image_mean,
                                self.resample) if blobs else None
        except Exception as e:  # noqa: BLE001  image bytes PIL cannot decode
            raise DropSample(f"unreadable_sample ({type(e).__name__}: {e})") from None
        if self.preference:
            return (*self.encode_pair(where, conv, bool(blobs), self.n_image_tokens), pixels)
        ids, labels, truncated = encode_conversation(conv, bool(blobs), self.template, self.tok, self.seq_len,
                                                     self.image_token_id, self.n_image_tokens)
        if truncated:
            self.skips.add("truncated_not_dropped", where)
        return ids, labels, pixels

    def encode_pair(self, where, conv, has_image, n_image_tokens):
        """(chosen (ids, labels), rejected (ids, labels)) of a preference sample (see encode_preference)."""
        if "rejected" not in conv[-1]:
            raise DropSample("not_a_preference_pair (no rejected answer in its last turn)")
        chosen, rejected, truncated = encode_preference(conv, has_image, self.template, self.tok, self.seq_len,
                                                        self.image_token_id, n_image_tokens,
                                                        self.vlm.video_token_id if self.vlm else None)
        if truncated:
            self.skips.add("truncated_not_dropped", where)
        return chosen, rejected

    def encode_tiled(self, sample):
        """(ids, labels, tiles (n, 3, S, S) uint8 or None, layouts): each tag expanded to its image's token count
        (anyres.image_layout), the tiles as the HF image processors make them (images.image_tiles)."""
        vlm = self.vlm
        where, conv, kind, blobs = self.read_conversation(sample)
        try:
            sizes = [image_hw(b) for b in blobs]
        except Exception as e:  # noqa: BLE001  image bytes with no readable header
            raise DropSample(f"unreadable_sample ({type(e).__name__}: {e})") from None
        if kind == "video" and vlm.video_token_id is None:
            raise DropSample(f"video_without_video_token ({len(blobs)} frames; the model has no video_token_id)")
        layouts = image_layouts(vlm, kind, sizes)
        n_tiles = sum(n for n, _, _ in layouts)
        if n_tiles > self.max_tiles:
            raise DropSample(f"too_many_tiles ({n_tiles} tiles, max_tiles {self.max_tiles})")
        if self.preference:
            encoded = self.encode_pair(where, conv, bool(blobs), [len(index) for _, index, _ in layouts])
        else:
            ids, labels, truncated = encode_conversation(conv, bool(blobs), self.template, self.tok, self.seq_len,
                                                         self.image_token_id, [len(index) for _, index, _ in layouts],
                                                         vlm.video_token_id)
            encoded = ids, labels
            if truncated:
                self.skips.add("truncated_not_dropped", where)
        try:
            tiles = sample_tiles(vlm, kind, blobs, self.image_mode, self.image_mean)
        except Exception as e:  # noqa: BLE001  bytes PIL cannot decode past the header
            raise DropSample(f"unreadable_sample ({type(e).__name__}: {e})") from None
        return *encoded, tiles, layouts

    def encode_or_drop(self, sample, at=None):
        """encode(sample), or None for a sample that cannot be trained on: counted, and the first few printed."""
        try:
            return self.encode(sample)
        except DropSample as e:
            self.drop(sample, str(e), at)
            return None

    def drop(self, sample, why, at=None):
        """Count a dropped sample (at: its place in the batch being built, whose drop_reason codes say why)."""
        shard, _, _ = self.index[sample]
        source = self.mixture.source_of(sample)  # a mixture's samples are named within their source
        where = storage.name(self.files[shard]) if len(self.mixture.sources) == 1 else \
            f"{storage.name(self.files[shard])} of source {self.mixture.sources[source].name}"
        number = sample - self.mixture.bases[source]
        reason = why.split(" ")[0]
        if at is not None:
            self.reasons[at] = 1 + DROP_REASONS.index(reason if reason in DROP_REASONS else "other")
        self.skips.add(reason, f"{where}#{number}")
        if self.skips.counts[reason] <= 3:
            log(f"data: dropped sample {number} of {where}: {why}")

    def batch(self, k):
        N = self.samples_per_batch
        sample_ids = torch.tensor([self.sample_at(k * N + i) for i in range(N)])
        if not self.reader.planned():  # a batch asked for by itself (evaluation): its samples fetched together
            self.reader.ahead(sample_ids.tolist())
        self.reasons = torch.zeros(N, dtype=torch.uint8)
        encoded = [self.encode_or_drop(sample, at) for at, sample in enumerate(sample_ids.tolist())]
        # a dropped sample keeps its place as padding with no labels: shapes are static, the position arithmetic holds
        dropped = torch.tensor([e is None for e in encoded])
        rows = self.pair_batch if self.preference else self.tiled_batch if self.max_tiles else self.single_batch
        batch = rows(sample_ids, encoded, dropped)  # marks in `dropped` the samples its rows had no room for
        return batch | self.by_source(sample_ids, encoded, dropped) | {"drop_reason": self.reasons}

    def by_source(self, sample_ids, encoded, dropped):
        """Each sample's source (its index in the mixture) and supervised tokens, 0 for a dropped one: the figures
        per source that train.py logs."""
        return {"source": torch.from_numpy(np.searchsorted(self.mixture.ends, sample_ids.numpy(), side="right")),
                "tokens": torch.tensor([0 if gone else supervised_tokens(e, self.preference)
                                        for e, gone in zip(encoded, dropped.tolist())])}

    def single_batch(self, sample_ids, encoded, dropped):
        """One image a row: pixel_values (N, 3, S, S) uint8; with pack, several samples a row (packed_batch)."""
        B, T, S, N = self.batch_size, self.seq_len, self.image_size, self.samples_per_batch
        images = torch.zeros((N, 3, S, S), dtype=torch.uint8)
        has_image = torch.zeros(N, dtype=torch.bool)
        if self.pack:
            kept = [i for i, e in enumerate(encoded) if e is not None]
            b = packed_batch([encoded[i][:2] for i in kept], B, T, self.tok.pad_id)
            for i, where in zip(kept, b["where"]):
                if where is None:  # no room left in this batch's rows: lower `pack` if this is frequent
                    self.drop(int(sample_ids[i]), f"no_room_in_pack ({len(encoded[i][0])} tokens)", i)
                    dropped[i] = True
            with_image = [kept[j] for j in b["order"] if encoded[kept[j]][2] is not None]
            for slot, i in enumerate(with_image):  # in placeholder order, as the model's packed convention wants
                images[slot], has_image[i] = encoded[i][2], True
            extra = {"position_ids": b["position_ids"]}
            input_ids, labels = b["input_ids"], b["labels"]
        else:
            input_ids = torch.full((B, T), self.tok.pad_id, dtype=torch.long)
            labels = torch.full((B, T), -100, dtype=torch.long)
            for row, e in enumerate(encoded):
                if e is not None:
                    ids, lab, pixels = e
                    input_ids[row, : len(ids)] = torch.tensor(ids)
                    labels[row, : len(lab)] = torch.tensor(lab)
                    if pixels is not None:
                        images[row], has_image[row] = pixels, True
            extra = {}
        return {"input_ids": input_ids, "labels": labels, "pixel_values": images,  # uint8: normalize_images on device
                "has_image": has_image, "dropped": dropped, "sample_id": sample_ids} | extra

    def pair_batch(self, sample_ids, encoded, dropped):
        """Preference pairs: input_ids and labels (2B, T), rows [chosen..., rejected...] (pair i in rows i and B + i),
        pixel_values once a pair: (B, 3, S, S), or (B, max_tiles, 3, S, S) with image_index / image_weight (2B, T,
        taps) placing the pair's tiles in both its rows. A dropped pair's rows have no labels: dpo_loss leaves them
        out."""
        from anyres import place_images

        B, T, vlm = self.batch_size, self.seq_len, self.vlm
        input_ids = torch.full((2 * B, T), self.tok.pad_id, dtype=torch.long)
        labels = torch.full((2 * B, T), -100, dtype=torch.long)
        if self.max_tiles:
            S, taps = vlm.vision.image_size, vlm.image_taps
            images = torch.zeros((B, self.max_tiles, 3, S, S), dtype=torch.uint8)
            image_index = torch.zeros((2 * B, T, taps), dtype=torch.long)
            image_weight = torch.zeros((2 * B, T, taps), dtype=torch.float32)
        else:
            images = torch.zeros((B, 3, self.image_size, self.image_size), dtype=torch.uint8)
        has_image = torch.zeros(B, dtype=torch.bool)
        for i, e in enumerate(encoded):
            if e is None:
                continue
            for row, (ids, lab) in ((i, e[0]), (B + i, e[1])):
                input_ids[row, : len(ids)], labels[row, : len(lab)] = torch.tensor(ids), torch.tensor(lab)
                if self.max_tiles and e[2] is not None:
                    image_index[row], image_weight[row] = place_images(input_ids[row], e[3], vlm)
            if e[2] is not None:
                if self.max_tiles:
                    images[i, : len(e[2])] = e[2]
                else:
                    images[i] = e[2]
                has_image[i] = True
        tiled = {"image_index": image_index, "image_weight": image_weight} if self.max_tiles else {}
        return {"input_ids": input_ids, "labels": labels, "pixel_values": images, "has_image": has_image,
                "dropped": dropped, "sample_id": sample_ids} | tiled

    def tiled_batch(self, sample_ids, encoded, dropped):
        """batch() with tile slots: pixel_values (B, max_tiles, 3, S, S) uint8 and image_index / image_weight
        (B, T, taps) from anyres.place_images, each row's images in placeholder order in its slots from slot 0."""
        from anyres import place_images

        B, T, vlm = self.batch_size, self.seq_len, self.vlm
        S, taps = vlm.vision.image_size, vlm.image_taps
        has_image = torch.tensor([e is not None and e[2] is not None for e in encoded])
        if self.pack:
            kept = [i for i, e in enumerate(encoded) if e is not None]
            n_tiles = [0 if encoded[i][2] is None else len(encoded[i][2]) for i in kept]
            b = packed_batch([encoded[i][:2] for i in kept], B, T, self.tok.pad_id, n_tiles, self.max_tiles)
            for i, where in zip(kept, b["where"]):
                if where is None:  # no room (tokens or tile slots) left in this batch's rows: lower `pack`
                    self.drop(int(sample_ids[i]), f"no_room_in_pack ({len(encoded[i][0])} tokens, "
                                                  f"{n_tiles[kept.index(i)]} tiles)", i)
                    dropped[i], has_image[i] = True, False
            rows = [[kept[j] for j in members] for members in b["rows"]]
            input_ids, labels, extra = b["input_ids"], b["labels"], {"position_ids": b["position_ids"]}
        else:
            input_ids = torch.full((B, T), self.tok.pad_id, dtype=torch.long)
            labels = torch.full((B, T), -100, dtype=torch.long)
            rows, extra = [[i] if e is not None else [] for i, e in enumerate(encoded)], {}
            for row, i in ((r, m[0]) for r, m in enumerate(rows) if m):
                ids, lab = encoded[i][:2]
                input_ids[row, : len(ids)], labels[row, : len(lab)] = torch.tensor(ids), torch.tensor(lab)
        pixel_values = torch.zeros((B, self.max_tiles, 3, S, S), dtype=torch.uint8)
        image_index = torch.zeros((B, T, taps), dtype=torch.long)
        image_weight = torch.zeros((B, T, taps), dtype=torch.float32)
        for row, members in enumerate(rows):
            with_images = [encoded[i] for i in members if encoded[i][2] is not None]
            if with_images:  # the row's images in the order of their placeholders: its samples' order
                tiles = torch.cat([e[2] for e in with_images])  # (n_tiles, 3, S, S)
                pixel_values[row, : len(tiles)] = tiles
                image_index[row], image_weight[row] = place_images(input_ids[row], [lay for e in with_images
                                                                                    for lay in e[3]], vlm)
        return {"input_ids": input_ids, "labels": labels, "pixel_values": pixel_values,  # uint8: normalised on device
                "image_index": image_index, "image_weight": image_weight, "has_image": has_image, "dropped": dropped,
                "sample_id": sample_ids} | extra

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        N, first = self.samples_per_batch, self.start // self.samples_per_batch + worker
        # this worker's batches are first, first + n_workers, ...: their samples, in order, are what a bucket's
        # ranged reads fetch ahead (shards.ShardReader); the order of the batches themselves is not touched
        self.reader.ahead(self.sample_at(k * N + i) for k in itertools.count(first, n_workers) for i in range(N))
        try:
            for k in itertools.count(first, n_workers):
                yield self.batch(k)
        except storage.StorageError as e:
            if info is None:
                raise
            # a worker's exception reaches the main process with its whole traceback as the message, and as another
            # class: the exception itself travels as the batch instead (pickled: its sentence and its class, which
            # says what to wait for: a shard restored, or a bucket that answers), and Loader raises it there
            yield {STORAGE_ERROR: e}
        finally:  # the consumer stopped (an evaluation's few batches): its requests ahead are not waited for
            self.reader.forget()


def supervised_tokens(encoded, preference=False):
    """The supervised tokens of an encoded sample (both answers of a preference pair): what it adds to the loss's
    units when it trains."""
    labels = [x for _, lab in encoded[:2] for x in lab] if preference else encoded[1]
    return sum(x != -100 for x in labels)


def pack_rows(lengths, n_rows, seq_len, tiles=None, max_tiles=0):
    """First-fit decreasing: place samples of the given lengths into n_rows rows of seq_len tokens (and, with
    max_tiles > 0, of max_tiles image tile slots, each sample taking tiles[i]).
    Returns (row, offset) per sample, None for a sample that found no room, and each row's samples in order."""
    free, rows, where = [seq_len] * n_rows, [[] for _ in range(n_rows)], [None] * len(lengths)
    tiles, free_tiles = tiles or [0] * len(lengths), [max_tiles] * n_rows
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r in range(n_rows) if free[r] >= lengths[i] and (not max_tiles or free_tiles[r] >= tiles[i])),
                   None)
        if row is not None:
            where[i] = (row, seq_len - free[row])
            free[row] -= lengths[i]
            free_tiles[row] -= tiles[i]
            rows[row].append(i)
    for r in rows:
        r.sort(key=lambda i: where[i][1])
    return where, rows


def packed_batch(samples, n_rows, seq_len, pad_id, tiles=None, max_tiles=0):
    """Several samples a row: input_ids, labels and position_ids (B, T); position 0 starts a sample, so the
    model keeps samples apart (model.Llama.forward). `order` lists the placed samples in flattened order: their
    images (text-only ones have none) go to pixel_values in that order; `rows` each row's samples in order;
    `where` is None for an unplaced sample. tiles/max_tiles: each sample's image tiles and a row's slots (pack_rows)."""
    where, rows = pack_rows([len(ids) for ids, _ in samples], n_rows, seq_len, tiles, max_tiles)
    input_ids = torch.full((n_rows, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((n_rows, seq_len), -100, dtype=torch.long)
    position_ids = torch.zeros((n_rows, seq_len), dtype=torch.long)
    for r, members in enumerate(rows):
        end = 0
        for i in members:
            ids, lab = samples[i]
            start, end = where[i][1], where[i][1] + len(ids)
            input_ids[r, start:end] = torch.as_tensor(ids)
            labels[r, start : start + len(lab)] = torch.as_tensor(lab)
            position_ids[r, start:end] = torch.arange(len(ids))
        position_ids[r, end:] = torch.arange(seq_len - end)  # the padding tail: one more (unsupervised) sample
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
            "order": [i for r in rows for i in r], "rows": rows, "where": where}


def mixture_change(saved, now, n_samples):
    """What differs between a checkpoint's sources (Mixture.describe) and this run's, in a few words."""
    if not saved:
        return f"one dataset of {n_samples} samples then, {', '.join(x['name'] for x in now)} now"
    before, after = {x["name"]: x for x in saved}, {x["name"]: x for x in now}
    said = [f"{name} {'dropped' if name not in after else 'added'}" for name in sorted(set(before) ^ set(after))]
    said += [f"{name}'s {k} {before[name][k]!r} -> {after[name][k]!r}" for name in before if name in after
             for k in after[name] if before[name].get(k) != after[name][k]]
    return "; ".join(said) or "the order of the sources"


def change_effects(saved, mix, old_position, new_position, **grouping):
    """{name: (repeats, skips, kept)}: for each source of `mix`, read from its position new_position on after a run
    that read the mixture `saved` (Mixture.describe()) up to old_position, the samples of its pass under way that it
    will show a second time, and those it will not show at all (a source is the same one by its path and split)."""
    shuffle_block = mix.orders[0].shuffle_block
    old = Mixture([Source(x["name"], x["path"], x["part"], x["weight"], x["repeat"], x["take"]) for x in saved],
                  "train", mix.seed, shuffle_block, **grouping)  # grouping: the same (a resume cannot change it)
    before = {(storage.canonical(x.path), x.part): j for j, x in enumerate(old.sources)}
    # each source's orders (grouped: one a modality) and its draws in each
    read_old, read_new = old.orders_before(old_position), mix.orders_before(new_position)
    def split(orders, i):  # (drawn, ahead) of the passes under way; one that just ended is under way, none ahead
        drawn, ahead = set(), set()
        for order, n in orders[i]:
            n_pass = max(n - 1, 0) // len(order.kept)
            drawn |= set(order.order(n_pass)[: n - n_pass * len(order.kept)].tolist())
            ahead |= set(order.order(n_pass)[n - n_pass * len(order.kept) :].tolist())
        return drawn, ahead

    out = {}
    for i, source in enumerate(mix.sources):
        k, j = len(mix.orders[i].kept), before.get((storage.canonical(source.path), source.part))
        ahead = split(read_new, i)[1]
        seen = split(read_old, j)[0] if j is not None else set()  # in the saved run's own order
        out[source.name] = (len(ahead & seen), k - len(ahead | (seen & set(mix.orders[i].kept.tolist()))), k)
    return out


PROBE = 32  # samples of each source encoded before the model is built, spread over what it keeps


def untrainable_sources(stream, n=PROBE):
    """[(source, {reason: samples}, samples probed)] for each source none of whose probed samples can train (n of
    them spread evenly over what it keeps, encoded as batches encode them): e.g. two-image records and max_tiles = 0.
    A source stops being probed at its first sample that encodes."""
    mix, out = stream.mixture, []
    for i, source in enumerate(mix.sources):
        kept = mix.orders[i].kept
        probed = np.unique(kept[np.linspace(0, len(kept) - 1, min(n, len(kept))).round().astype(int)])
        reasons = {}
        for local in probed.tolist():
            try:
                stream.encode(mix.bases[i] + local)
                break
            except DropSample as e:
                reason = str(e).split(" ")[0]
                reasons[reason] = reasons.get(reason, 0) + 1
        else:
            out.append((source, reasons, len(probed)))
    return out


def untrainable_sentence(stream, settings):
    """The refusal of a source none of whose probed samples can train with these settings ({seq_len, max_tiles,
    ...}), or None: it would draw its share of every batch and train on nothing, to the end."""
    for source, reasons, n in untrainable_sources(stream):
        where = f"data_dir {source.path!r}" if len(stream.mixture.sources) == 1 else \
            f"data_dir source {source.name} ({source.path})"
        why = ", ".join(f"{reason} {k}" for reason, k in sorted(reasons.items(), key=lambda kv: -kv[1]))
        said = ", ".join(f"{k} {v}" for k, v in settings.items())
        return (f"{where}: none of its samples can train with this run's settings ({said}): all {n} probed across it "
                f"drop ({why}); change the settings or leave the source out")
    return None


def _survive_group_signals(worker_id):
    """DataLoader worker init. Schedulers signal the whole process group (VM shutdown, SLURM, systemd, kill -- -PGID):
    a worker that died of it would make the main process raise before its stop checkpoint. SIGINT is ignored;
    SIGTERM is blocked and a thread ends the worker only when the parent sends it (DataLoader's own shutdown).
    A worker whose parent dies exits by itself (DataLoader's watchdog)."""
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    parent = os.getppid()

    def wait_for_parent_term():
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
            pass
        os._exit(0)

    threading.Thread(target=wait_for_parent_term, daemon=True).start()


class Loader:
    """Wraps ShardStream in a DataLoader and counts what it hands out; state_dict() is that position.
    mixture_change: what a resume on another mixture (allow_config_change=['data_dir']) does: 'continue' reads it
    from the saved position, 'restart_epoch' from its own start, so that each kept sample is read once an epoch."""

    def __init__(self, stream, num_workers=0, prefetch_factor=4, mixture_change="continue"):
        self.stream, self.num_workers, self.prefetch_factor = stream, num_workers, prefetch_factor
        self.position, self.mixture_change = 0, mixture_change
        # per source, its supervised tokens and its dropped samples by reason (DROP_REASONS): this rank's since the
        # last fold, and every rank's before it
        n = len(stream.mixture.sources)
        self.tokens, self.tokens_total = (torch.zeros(n, dtype=torch.long) for _ in range(2))
        self.dropped, self.dropped_total = (torch.zeros((n, len(DROP_REASONS)), dtype=torch.long) for _ in range(2))
        # a resumed run's figures by source name as saved, and the global position they were saved at
        self.carried, self.since = {"samples": {}, "tokens": {}, "dropped": {}}, 0
        self.said = None  # the totals at the last quiet_sources()

    def __iter__(self):
        self.stream.start = self.position
        kw = {"prefetch_factor": self.prefetch_factor, "persistent_workers": False,
              "worker_init_fn": _survive_group_signals} if self.num_workers else {}
        n, n_reasons = self.dropped.shape
        # its base seed from a generator of its own: a DataLoader draws it from the global RNG when it starts, which
        # shifted the dropout masks (LoRA's) of a resumed run, whose loader starts after the RNG state is restored
        for batch in torch.utils.data.DataLoader(self.stream, batch_size=None, num_workers=self.num_workers,
                                                 generator=torch.Generator(), **kw):
            if STORAGE_ERROR in batch:  # a bucket unreachable, or a shard gone, in a worker (ShardStream.__iter__)
                raise batch[STORAGE_ERROR]
            self.position += self.stream.samples_per_batch
            self.tokens += torch.bincount(batch["source"], batch["tokens"], minlength=n).long()
            code = batch["drop_reason"].long()
            gone = code > 0
            self.dropped += torch.bincount(batch["source"][gone] * n_reasons + code[gone] - 1,
                                           minlength=n * n_reasons).view(n, n_reasons)
            yield batch

    def skipped(self, batches, reason="skip_steps"):
        """Batches a step read and did not train on (skip_steps, or an update skipped): their samples count as dropped
        for `reason`, their tokens as not trained."""
        self.not_trained(self.step_counts(batches), reason)

    def step_counts(self, batches):
        """(2, sources): the samples of `batches` not dropped, and their supervised tokens, by source."""
        n = len(self.tokens)
        return sum((torch.stack([torch.bincount(b["source"][b["drop_reason"] == 0], minlength=n),
                                 torch.bincount(b["source"], b["tokens"], minlength=n).long()]) for b in batches),
                   torch.zeros((2, n), dtype=torch.long))

    def not_trained(self, counts, reason):
        """counts (step_counts, of steps that did not update the weights): dropped for `reason`, tokens not trained."""
        self.tokens -= counts[1]
        self.dropped[:, DROP_REASONS.index(reason)] += counts[0]

    def fold_tokens(self, env):
        """Every rank's supervised tokens and dropped samples per source since the last fold into the run's totals
        (a collective over the ranks: every rank calls it at the same step)."""
        both = env.host_sum(torch.cat([self.tokens, self.dropped.flatten()]))
        self.tokens_total += both[: len(self.tokens)]
        self.dropped_total += both[len(self.tokens) :].view_as(self.dropped)
        self.tokens.zero_()
        self.dropped.zero_()

    def totals(self):
        """{"samples": {name: samples drawn by all ranks}, "tokens": {name: supervised tokens trained},
        "dropped": {name: {reason: samples}}} of the run so far, as of the last fold_tokens: what it drew before a
        resume (by name, of sources it may no longer read) and since."""
        s = self.stream
        mix, now = s.mixture, self.position * s.world_size - s.origin
        drawn = mix.counts_before(now) - mix.counts_before(self.since - s.origin)
        out = {kind: {name: dict(v) if isinstance(v, dict) else v for name, v in self.carried.get(kind, {}).items()}
               for kind in ("samples", "tokens", "dropped")}
        for i, name in enumerate(s.mixture.names()):
            out["samples"][name] = out["samples"].get(name, 0) + int(drawn[i])
            out["tokens"][name] = out["tokens"].get(name, 0) + int(self.tokens_total[i])
            reasons = out["dropped"].setdefault(name, {})
            for reason, k in zip(DROP_REASONS, self.dropped_total[i].tolist()):
                if k:
                    reasons[reason] = reasons.get(reason, 0) + k
        return out

    def figures(self):
        """{samples/NAME (drawn), trained/NAME, dropped/NAME, dropped/NAME/REASON, tokens/NAME (supervised tokens
        trained)} of a run on a mixture (totals()); {} for one dataset."""
        totals = self.totals()
        if len(totals["samples"]) == 1:
            return {}
        out = {}
        for name, drawn in totals["samples"].items():
            reasons = totals["dropped"].get(name, {})
            out |= {f"samples/{name}": drawn, f"trained/{name}": drawn - sum(reasons.values()),
                    f"dropped/{name}": sum(reasons.values()), f"tokens/{name}": totals["tokens"].get(name, 0)}
            out |= {f"dropped/{name}/{reason}": k for reason, k in sorted(reasons.items())}
        return out

    def quiet_sources(self):
        """A sentence for each source that drew samples since the last call (or the start) but trained no token:
        every one of them dropped (the reasons counted), or none had a supervised token."""
        now, before, said = self.totals(), self.said or self.carried, []
        self.said = now
        for name, drawn in now["samples"].items():
            drawn -= before["samples"].get(name, 0)
            if not drawn or now["tokens"][name] != before["tokens"].get(name, 0):
                continue
            was = before.get("dropped", {}).get(name, {})
            reasons = {r: k - was.get(r, 0) for r, k in now["dropped"][name].items() if k > was.get(r, 0)}
            gone = sum(reasons.values())
            why = ", ".join(f"{r} {k}" for r, k in sorted(reasons.items()))
            said.append(f"source {name} trained no token in this log interval: "
                        + (f"{f'all {drawn} samples' if drawn > 1 else 'the one sample'} it drew dropped ({why})"
                           if gone == drawn else
                           f"{gone} of the {drawn} samples it drew dropped{f' ({why})' if why else ''}, the others "
                           "had no supervised token"))
        return said

    def summary(self):
        """A line for each source the run drew from: samples drawn, trained and dropped (by reason), supervised
        tokens trained, and the epochs of what it keeps (for the sources read now)."""
        totals, mix = self.totals(), self.stream.mixture
        kept = dict(zip(mix.names(), mix.kept_sizes))
        lines = []
        for name, drawn in totals["samples"].items():
            reasons = totals["dropped"].get(name, {})
            gone = sum(reasons.values())
            lines.append(f"data: source {name}: {drawn:,} samples drawn, {drawn - gone:,} trained, {gone:,} dropped"
                         + (f" ({', '.join(f'{r} {k:,}' for r, k in sorted(reasons.items()))})" if gone else "")
                         + f", {totals['tokens'].get(name, 0):,} supervised tokens"
                         + (f", {drawn / kept[name]:.2f} epochs of the {kept[name]:,} samples it keeps"
                            if name in kept else ""))
        return lines

    def state_dict(self):
        s = self.stream
        # every rank is at the same position of its own stream, so one state serves all ranks; global_position
        # (samples consumed by all ranks together) is what a resume on another world size continues from; origin:
        # the global position where this mixture's position 0 lies (mixture_change='restart_epoch')
        return {"position": self.position, "global_position": self.position * s.world_size, "seed": s.seed,
                "n_samples": len(s), "world_size": s.world_size, "batch_size": s.batch_size, "pack": s.pack,
                "sources": s.mixture.describe(), "by_source": self.totals(), "origin": s.origin, "group": s.group}

    def load_state_dict(self, state, allow_new_data=False):
        """The saved position. A saved mixture (data_dir) unlike this run's is refused, unless allow_new_data
        (allow_config_change=['data_dir']): then this mixture goes on from the saved global position, or starts an
        epoch there (mixture_change)."""
        s, state = self.stream, {"pack": 0, "group": 0} | state  # states from before packing, grouping existed
        mine = {"seed": s.seed, "n_samples": len(s), "pack": s.pack, "group": s.group}
        if "sources" in state:  # states from before mixtures: one dataset, its sample count
            mine["sources"] = s.mixture.describe()
        differ = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        consumed = state["position"] * state.get("world_size", 1)  # global: every rank is at the same position
        s.origin = state.get("origin", 0)
        if allow_new_data and set(differ) <= {"n_samples", "sources"}:
            if differ:
                self.changed(state, consumed)
            differ = {}
        if "sources" in differ or ("n_samples" in differ and len(s.mixture.sources) > 1):
            raise ValueError(f"the checkpoint's run read other data than this data_dir names "
                             f"({mixture_change(state.get('sources'), s.mixture.describe(), state['n_samples'])}): "
                             f"resume with the same mixture, or add data_dir to allow_config_change to go on with "
                             f"this one from the saved position")
        if differ:
            raise ValueError(f"data loader state does not match this run (saved, now): {differ}")
        if consumed % (s.samples_per_batch * s.world_size):  # the global batch changed with the world size
            raise ValueError(f"the checkpoint's loader stopped after {consumed} samples, which is not a whole number "
                             f"of this run's global batches ({s.world_size} ranks x {s.samples_per_batch} samples): "
                             f"keep the global batch (batch_size) the same across the change")
        self.position = consumed // s.world_size
        if "by_source" in state:  # the run's figures so far, by name; this run's draws are counted from here
            self.carried, self.since = {"dropped": {}} | state["by_source"], consumed
        self.tokens_total.zero_()
        self.dropped_total.zero_()

    def changed(self, state, consumed):
        """Say what a mixture change does to the epoch under way, per source; with mixture_change='restart_epoch'
        the new mixture starts at its own position 0 here."""
        s = self.stream
        was = ", ".join(x["name"] for x in state.get("sources", [])) or f"{state['n_samples']} samples"
        head = f"resume: the data changed (allowed by allow_config_change): from {was} to {', '.join(s.mixture.names())}"
        if self.mixture_change == "restart_epoch":
            s.origin = consumed
            log(f"{head}; mixture_change='restart_epoch': the new mixture starts its first epoch at global position "
                f"{consumed}, so that each sample it keeps is read once an epoch from here (nothing repeated or "
                f"skipped in it)")
            return
        try:
            effects = change_effects(state["sources"], s.mixture, consumed - state.get("origin", 0), consumed - s.origin,
                                     group=s.group, by_length=not s.pack)
            said = "; in the pass over its samples under way, " + ", ".join(
                f"{name} will repeat {rep} and skip {skip} of its {k}" for name, (rep, skip, k) in effects.items())
        except (KeyError, OSError, ValueError) as e:  # the saved mixture's files gone: what it read is not known
            said = f"; what the saved mixture read cannot be known now ({e})"
        log(f"{head}; the new mixture is read from global position {consumed}{said} (mixture_change='restart_epoch' "
            f"starts an epoch here instead, so that once-each holds)")
