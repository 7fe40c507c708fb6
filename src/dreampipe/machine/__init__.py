"""This machine as the planner sees it: calibration, co-run profiles, local plan choice.

``calibration`` holds a machine's measured figures and turns them into the
simulator's costs and the planner's topology; ``corun``, ``rates`` and
``overhead`` measure what a profile taken beside busy workers needs;
``local_plan`` profiles, plans and predicts for the workers at hand, which
``Pipeline(plan="auto")`` and the commands share.
"""
