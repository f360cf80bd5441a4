"""load_yaml: the one YAML reader of everything autopar reads (plans, cache entries, calibrations, checkpoint
metadata): yaml.safe_load's plain values (no tags, nothing that runs code), and three refusals more, each a
yaml.YAMLError whose message says what to change (the callers turn it into their own typed error, naming the
file):

- aliases (`*name`): a few hundred bytes of nested aliases expand to gigabytes (a 741-byte plan took 51 s and
  1.6 GB in Plan.load before this), and autopar's files never need them;
- duplicate keys in a mapping, where yaml.safe_load silently keeps the last;
- text over MAX_YAML_CHARS (autopar's own files are a few KiB);
- nesting deeper than MAX_YAML_DEPTH collections (autopar's files nest four or five deep; yaml's composer
  recurses once a level, so `[[[...]]]` 5,000 deep raised RecursionError, not a YAML error, before this).
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.events import AliasEvent, MappingStartEvent, SequenceStartEvent
from yaml.nodes import MappingNode

MAX_YAML_CHARS = 1 << 20  # characters; a plan is about 1 KiB, a cache entry or a calibration 2-4 KiB
MAX_YAML_DEPTH = 32  # nested collections (mappings, lists); a plan cache entry nests four deep


class DuplicateKeyError(yaml.YAMLError):
    """A mapping with one key twice (yaml.safe_load would keep the last silently)."""


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader without aliases, without duplicate keys and at most MAX_YAML_DEPTH collections deep."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"YAML aliases (*{event.anchor}) are not accepted here: write the value out in full",
                event.start_mark)
        if not self.check_event(MappingStartEvent, SequenceStartEvent):
            return super().compose_node(parent, index)
        if self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"the YAML nests more than {MAX_YAML_DEPTH} lists or mappings deep: autopar's files "
                "nest a few levels; give the file autopar wrote", self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, MappingNode):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: SafeLoader refuses it itself
                    continue
                if duplicate:
                    line = key_node.start_mark.line + 1
                    raise DuplicateKeyError(f"the key {key!r} appears twice in one mapping (again on line {line}): "
                                            "keep one")
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """`text`'s YAML as plain values (yaml.safe_load's), refusing aliases, duplicate keys, oversized text and
    nesting deeper than MAX_YAML_DEPTH, each as a yaml.YAMLError."""
    if len(text) > MAX_YAML_CHARS:
        raise yaml.YAMLError(f"the YAML text is {len(text):,} characters, more than the {MAX_YAML_CHARS:,} accepted")
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass: plain values only
    except RecursionError:  # the depth bound stops the composer first; this is the backstop
        raise yaml.YAMLError(f"the YAML nests too deep to read (more than {MAX_YAML_DEPTH} lists or mappings): "
                             "give the file autopar wrote") from None
