"""Hugging Face formats: safetensors files and ``transformers`` model directories in (each rank
reads only its slices) and out (streamed shards).

Modules: :mod:`~meshtrain.train.hf.files` (where a checkpoint's tensors live; headers only),
:mod:`~meshtrain.train.hf.load` (:func:`~meshtrain.train.hf.load.load_hf`),
:mod:`~meshtrain.train.hf.export` (:func:`~meshtrain.train.hf.export.export_hf`) and
:mod:`~meshtrain.train.hf.single_file` (one safetensors file for inference or to start a run).
"""
