"""Agent tools: ``execute_bash``, ``str_replace_editor`` and ``submit`` (see ``toolbox``)."""

from sandpiper.collector.episode.tools.schemas import TOOL_SCHEMAS, offered_schemas
from sandpiper.collector.episode.tools.toolbox import Toolbox

__all__ = ["TOOL_SCHEMAS", "Toolbox", "offered_schemas"]
