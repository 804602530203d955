"""Acting on decisions: the store, the commands, their delivery.

* :mod:`.actor`: a batch's incidents stored with their commands, then the deliverers woken;
* :mod:`.commands`: from a decision to the commands (and approval request) it leads to;
* :mod:`.store`, :mod:`.store_writer`: durable incidents, commands, approvals (SQLite);
* :mod:`.dispatch`, :mod:`.actuators`: delivery over webhooks, the pull API, local commands;
* :mod:`.signing`: Standard Webhooks signatures;
* :mod:`.failure_log`: the recent failures the control API lists, and their log lines.
"""
