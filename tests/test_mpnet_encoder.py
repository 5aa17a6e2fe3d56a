"""A non-BERT encoder end to end: a tiny random MPNet (the architecture of all-mpnet-base-v2,
the paper's 12 x 768 shape; no token type ids, positions offset by the padding index, <s> and
</s> specials) through word-piece alignment, the tagger, training, save/load and the engine."""

from __future__ import annotations

import pytest
import torch

from mhmla_fast.ged.model import GedTagger, TaggerConfig, encode_sentences, encode_words, load_tokenizer
from mhmla_fast.ged.train import TrainConfig, train
from synthetic_fce import write_agreement_fce

VOCAB = ["<s>", "<pad>", "</s>", "<unk>", "[UNK]", "<mask>", ".", ",", "he", "she", "they", "we",
         "go", "##es", "to", "school", "##s", "every", "day", "the", "house", "a", "cat", "see",
         "went", "dog"]


@pytest.fixture(scope="module")
def tiny_mpnet(tmp_path_factory):
    from transformers import MPNetConfig, MPNetModel, MPNetTokenizerFast

    d = tmp_path_factory.mktemp("tiny-mpnet")
    tok = MPNetTokenizerFast(vocab={piece: i for i, piece in enumerate(VOCAB)}, do_lower_case=True)
    torch.manual_seed(0)
    cfg = MPNetConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=48, max_position_embeddings=68,
                      pad_token_id=tok.pad_token_id)
    MPNetModel(cfg, add_pooling_layer=False).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def test_word_pieces_align_to_words(tiny_mpnet):
    tok = load_tokenizer(tiny_mpnet)
    assert "token_type_ids" not in tok.model_input_names
    (ids, index), = encode_sentences(tok, [["He", "goes", "to", "schools", "."]], 32)
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces == ["<s>", "he", "go", "##es", "to", "school", "##s", ".", "</s>"]
    assert index == [-1, 0, 1, -1, 2, 3, -1, 4, -1]  # first piece of each word; specials -1
    # a word the vocabulary cannot spell still keeps its position (as the unknown token)
    (_, index), = encode_sentences(tok, [["he", "zzz", "."]], 32)
    assert [w for w in index if w >= 0] == [0, 1, 2]


def write_fce(path, n, seed):
    return write_agreement_fce(path, n, seed, ["the", "house", "a", "cat", "dog", "school",
                                               "every", "day"], max_rest=5)


def test_mpnet_tagger_trains_saves_loads_and_serves(tmp_path, tiny_mpnet):
    from mhmla_fast.serve.engine import Engine

    cfg = TrainConfig(train=str(write_fce(tmp_path / "train.tsv", 96, 0)),
                      dev=str(write_fce(tmp_path / "dev.tsv", 24, 1)), out=str(tmp_path / "run"),
                      encoder=tiny_mpnet, num_heads=4, epochs=2, batch_size=8, lr=2e-3,
                      max_length=32, seed=3, checkpoint_every=1000, progress=False, backend="torch")
    best = train(cfg)
    model = GedTagger.load(best).eval()
    assert model.encoder.config.model_type == "mpnet"
    assert model.head.num_layers == 2 and model.head.w_v.shape == (2, 32, 32)
    tok = load_tokenizer(best)
    batch = encode_words(tok, [["he", "go", "to", "school", "."]], 32)
    with torch.no_grad():
        logits, p = model(batch["input_ids"], batch["attention_mask"], return_weights=True)
    assert logits.shape == (1, batch["input_ids"].shape[1], 2) and p.shape[-2:] == (2, 4)
    torch.testing.assert_close(p.sum(-2), torch.ones_like(p.sum(-2)))
    # the engine (raw text -> words -> pieces) gives the tagger's own word probabilities
    engine = Engine.load(best, backend="torch", device="cpu")
    result, = engine.tag_texts(["he go to school ."])
    assert result.tokens == ["he", "go", "to", "school", "."]
    first = batch["word_index"][0] >= 0
    expected = logits.softmax(-1)[0, first, 1].numpy()
    assert len(result.probs) == 5
    torch.testing.assert_close(torch.tensor(result.probs, dtype=torch.float32),
                               torch.from_numpy(expected), rtol=1e-4, atol=1e-5)


def test_input_limit_counts_the_offset_positions():
    from transformers import BertConfig, MPNetConfig

    from mhmla_fast.encoder import max_input_length

    assert max_input_length(BertConfig(max_position_embeddings=512)) == 512
    assert max_input_length(MPNetConfig(max_position_embeddings=514, pad_token_id=1)) == 512
    assert max_input_length({"model_type": "roberta", "max_position_embeddings": 514,
                             "pad_token_id": 1}) == 512
    assert max_input_length({"model_type": "bert", "max_position_embeddings": 128}) == 128
    assert max_input_length({}) == 512


def test_mpnet_tagger_tags_texts_longer_than_its_positions_and_exports(tmp_path, tiny_mpnet):
    """all-mpnet-base-v2 has 514 positions for 512 inputs: an engine or export that took 514
    (or here 68 for 66) as the input limit indexed past the position table."""
    from mhmla_fast.serve.engine import Engine
    from mhmla_fast.serve.onnx_export import export_onnx

    torch.manual_seed(0)
    tagger = GedTagger(TaggerConfig(encoder=tiny_mpnet, num_heads=4, threshold=0.5))
    model_dir = tagger.save(tmp_path / "tagger", tokenizer=load_tokenizer(tiny_mpnet))
    engine = Engine.load(model_dir, backend="torch", device="cpu")
    assert engine.max_pieces == 66  # 68 positions less pad_token_id + 1
    words = ("he goes to schools every day , she see the dog ." * 12).split()  # 132+ pieces
    result, = engine.tag_tokens([words])
    assert len(result.labels) == len(words)
    export_onnx(model_dir, tmp_path / "onnx")  # validates ONNX Runtime against torch up to 66
    onnx_result, = Engine.load(tmp_path / "onnx", backend="onnx").tag_tokens([words])
    assert onnx_result.labels == result.labels
    torch.testing.assert_close(torch.tensor(onnx_result.probs), torch.tensor(result.probs),
                               rtol=1e-4, atol=1e-5)


def test_offset_position_types_are_hugging_face_model_types():
    from transformers import CONFIG_MAPPING

    from mhmla_fast.encoder import OFFSET_POSITION_TYPES

    assert all(t in CONFIG_MAPPING for t in OFFSET_POSITION_TYPES)


def test_an_fp16_checkpoint_loads_as_fp32_parameters(tmp_path):
    """Training updates fp32 weights even when the encoder travelled as fp16 (transformers 5
    keeps a checkpoint's dtype unless told otherwise); the values are the file's exactly."""
    import torch
    from transformers import BertConfig, BertModel

    from mhmla_fast.encoder import load_encoder

    torch.manual_seed(0)
    small = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=32)).half()
    small.save_pretrained(tmp_path / "fp16")
    encoder, config = load_encoder(str(tmp_path / "fp16"))
    assert {p.dtype for p in encoder.parameters()} == {torch.float32}
    stored = dict(small.named_parameters())
    assert all(torch.equal(p, stored[n].float()) for n, p in encoder.named_parameters())
    # the config a model directory stores says what the parameters are
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    rebuilt, rebuilt_config = load_encoder(str(tmp_path / "fp16"), {**config, "dtype": "float16"})
    assert {p.dtype for p in rebuilt.parameters()} == {torch.float32}
    assert rebuilt_config["dtype"] == "float16"  # a stored config is handed back as it was
