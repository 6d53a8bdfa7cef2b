"""stitch as an HLO pass inside XLA's compiler: ``entry`` (the compile entry points and the
pass's public names), ``pass_registration`` (registered with XLA, XLA's callback),
``pass_request`` (one compile's request and report), ``pass_planning`` (plan, lower and place
one module's kernels), ``snap`` and ``hlo_rewrite`` (kernels put into XLA's module),
``kernel_builds`` / ``ptx_children`` / ``host_builds`` (device builds), ``payback`` /
``code_budget`` (which kernels are worth building), the kernels placed outside the plan
(``attention_backward_jobs``, ``lm_head_placement``, ``segment_rows``), ``delivered``
(the final module priced) and ``deviceless`` (the pass in a deviceless compile, for checks).
Importing the package imports none of them."""
