"""Agent tools: ``execute_bash``, ``str_replace_editor`` and ``submit`` (see ``toolbox``)."""

from sandpiper.collector.tools.schemas import TOOL_SCHEMAS, offered_schemas
from sandpiper.collector.tools.toolbox import Toolbox

__all__ = ["TOOL_SCHEMAS", "Toolbox", "offered_schemas"]
