"""V4.1's published Engram values, spelled out here (not imported from lib/engram) so a slip in the
module cannot agree with itself. Sources (as the project's V4.1 reference notes cite them):
  [EN]  official DeepSeek-V4.1 inference/engram.py, code-index id 71212907549
  [TT]  torchtitan-npu Engram tests, ids 69332611211 and 68299168060
  [RCF] Rust V4.1 config module (extracted multipliers), id 68298598583
  [REL] pinned release record (engram_num_embeddings), id 68878548201
"""

# [EN][TT]: the 48 consecutive primes above 16,000,000, layer 1 then layer 14, orders 2, 3, 4, 8 heads each
PRIMES_1 = (16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183,
            16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321,
            16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463)
PRIMES_14 = (16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627,
             16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769,
             16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889)
ROWS = (384_006_168, 384_016_682)          # [REL] engram_num_embeddings
# [EN][RCF]: m = 2 * default_rng(10007 * layer).integers(0, B, 4) + 1, B for 99,092 compressed ids
MULTIPLIERS_1 = (76632096046245, 4839876093313, 35959672319349, 73987337458391)
MULTIPLIERS_14 = (67716810739261, 51510806800915, 30921347202721, 82619226485591)
