"""The worker group on Ray, as the controller drives it: every Ray call of the controller.

``port.RayGroup`` implements ``elastic.group_port.GroupPort`` over ``worker.group``;
``survivors`` gathers what a broken group shows (healthy processes, the failure's origin),
``death`` Ray's verdict on each lost process, ``cluster`` the free resources, live nodes and
drain notices, ``diagnostics`` every worker's stacks.  ``elastic/`` decides from the data
these return and imports no Ray.
"""
