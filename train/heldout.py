"""Evaluation prompts stay out of training data.

A head trained on the prompts it is evaluated on reports a tau it will not
reach on new prompts, and nothing in the numbers shows it. So regeneration
refuses (rather than warns about) two kinds of prompt:

- a prompt of a known evaluation set: the 480 first turns of Spec-Bench,
  which holds all 80 MT-bench questions and 80 GSM8K *test* questions, so an
  MT-bench, Spec-Bench or GSM8K-test file is caught by any one of its
  prompts. Known prompts are stored as fingerprints (below), not as text;
- a prompt of the run's own evaluation file (``eval.prompts``), compared in full.

Prompts compare after collapsing whitespace and case. There is no switch to
allow them: a file that mixes training and evaluation prompts should be split.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

# sha256(normalize(first turn))[:12] of every question in Spec-Bench's spec_bench_question.jsonl
# (hemingkx/Spec-Bench; 480 questions in 13 categories: MT-bench's 80, and translation, summarization,
# qa, math_reasoning (GSM8K test), rag). 48 bits: a chance collision among ~10^4 training prompts is ~1e-8.
# Rebuilt by: {key(r["turns"][0]) for r in map(json.loads, open("spec_bench_question.jsonl"))}.
KNOWN_EVALUATION_PROMPTS = frozenset(
    (
        "01e9f74c4144 030f315decca 039030201f60 03bd29fdec70 03bf8dd643bd 048b80b63ef3 04c10db62566 0509e2d711ce "
        "05b36a814a76 05b61cfe6000 05f0635295c6 05f447c020a3 0756cd6ec30a 07e5b8f769e2 09320d0bd960 09b9265f7e28 "
        "09fcbdac6e3e 0afca1ce9f06 0bbb266caca4 0be117a77670 0c7e51a65d81 0d58533be9a2 0d69ed20df55 0d8aec9dfb68 "
        "0dd353de87ac 0df5373de245 0e5674e4d711 0e57bb7c062e 0ec7cb68e200 0f4221c6ad5c 0f4cfc9a72cc 0fa23949c2d1 "
        "0fe0f9c28352 10bb7d8d2201 10f1aa832f5d 112cd2641a66 118336879cda 12697ead2592 126a709df0c3 1354e0638e19 "
        "13a323905a9d 150f3a793e4f 1535e04cd694 1594f30f7661 15b02d95b874 15dd1e0777ea 1697c3123eaf 16a508a7e145 "
        "16d6b8a610b2 1805cf886168 18274fed59c8 188c25b10abc 18eba02f9fb3 198d13e92421 199f64796cbc 1a417dcaa3a3 "
        "1a89030371ef 1a9c1c2f1eed 1ac116fc796d 1b48c3d4ab83 1b5c3885c3b7 1b601e7284de 1b82b19a4faa 1b97081bf65a "
        "1de59aceddb4 1ed3f17de2a4 1efbcfcd7d68 1f16f2be78d3 1fd207d7b028 20352f803847 20b4cf95d109 2118b40c7528 "
        "211f51e52eb0 218ebed70910 2269ce9f1319 2272adc30757 22a2b3fee29b 2337d570b4d8 239e26bbf7aa 23a8448ca332 "
        "23c58aff3861 24248a47fb72 2545cdbc1d47 260ee9c350c4 262e1e6b972c 2665df6d4df9 271a87d8291a 27696a3c1528 "
        "284c5c35b6e0 284e96c1b9c5 28a2693fbf7f 2946c596277b 2a95a6f3fbf8 2b5ccb02b992 2b68785e8fb0 2b9880de4f78 "
        "2baaed1a1c38 2c6eba29ce91 2d2d8e0e6f2b 2e0c7bc23b06 2eb968e3f453 301bbaf653d8 311bb42a3337 3192384856a1 "
        "31c5039d332c 31e47f17054d 32d5861952b3 3313f22ffe82 33c1bac8a0c8 3458d44a8fe6 346a730e5900 346ac0c34bc6 "
        "353e4c1bf0bb 359186ede3f8 36026c793d5f 3616f7fea604 377ad0be9118 378e4b11ef7f 3979d642f72f 399fead69de5 "
        "3b11b4b364b2 3b78eb2b318d 3b8670e085ea 3c10cb72232a 3c1b8adb7456 3c49ca1025b1 3d0c537a7c75 3d525cf2f757 "
        "3d6aed628033 3def50bbb551 3e0884ac88a2 3f2c1564e7cc 3f667047f8ac 4009a9d57b17 404124691f7c 4129fe8786e0 "
        "42451897a70e 4262e8e0f191 42ae3039e37b 4320acd5c405 438d33d80e84 44d76e3f9409 45ee8182c9fa 45fa1d35dc67 "
        "463b3d7c8a1a 46549cff0902 4743b7af54f6 474d85a862df 480e4a316d7e 489bcb04e888 48ddde958aef 49c35cc5b00c "
        "4b1c03d53ccd 4ca1abba77aa 4d09cf40f8c8 4d744a634ede 4daa6628cb98 4dac6eb77ec8 4df7a205fdc2 4f2b769c13de "
        "500a2ee9a246 5089dfbe7829 50b7120595bf 51e048acb18d 52ccd1a78f60 542eda740c64 547a04fb1a23 54c9429499fa "
        "54dc24dcf05b 54e633479d56 5555a2a89715 56ed3fd8e76b 57c0d7642bff 5a187983b2ee 5b0f4a4a3114 5b64f5db4965 "
        "5bdca9ab886a 5c1816bf20a0 5c313ea27d5c 5c6b3d7b92d1 5c91b38518d8 5cc48eeac69b 5fbf56949964 5feb6fe1fb28 "
        "5ff83b61ef88 60788894510b 60d60f8c0c3a 61b0313fc7e0 61c9b067b65b 621e6edf1b0b 62a83371a91a 6364f1395719 "
        "63c107fba971 642bef6bc643 643b25b7838a 64722330cbd3 65187c236a93 6561c61cdf2e 66c9d01bc89f 670725f0eaa7 "
        "67257eea5ccf 674aa6accefc 6761a1b3ba47 6774f1723ae3 681e7dafa64e 682150eb8300 689d8d92f683 68b8c1d62d34 "
        "692547a83c89 6ab46994907c 6abcab840d6f 6b1db37954f7 6b4e61c1fc56 6b9331be2636 6bab61497f09 6bda2f700fbf "
        "6cefd8ea9a84 6d575c1c5206 6e4773b2d835 6fb67ab19108 70350fc2b145 70f73e4c295a 711b305d2783 715b30778c94 "
        "71976272ffde 71d0bf9250cf 73300ac7e323 7383cf0e1db1 73c6369e131f 74beafcb7b78 758708744f3a 76784c074735 "
        "77281157b82a 7813ec844122 7859cdb917cb 79a565098a04 7ab48552ec2b 7ac2d3825eae 7ad1a48ece31 7c989e3cb430 "
        "7cbb494f56ec 7df4380ce8e8 7e710d8ff3d4 7ec6dbfda050 7f0fedd80000 7fbcfb60bcbc 7ff8155623d0 80541b01f6aa "
        "8083102f1577 81c09b431098 82073e3c0446 842e2007aaa8 85269a949447 8645045f164f 870ae1ca669d 87df25146fa3 "
        "8ae578a13f01 8b5ce896f6cc 8bf85ecfd2fa 8c790fb0acf3 8c7c9bd58c8f 8c91a722a161 8c9fd4dd9b80 8cac200644ac "
        "8cb0e4e37235 8e0b69337f38 8e84640fffe0 90363abff4fc 90a7a3a9dfc1 90b6fe0af012 911c34d574c6 915583cdc3b9 "
        "91c6c29a73b3 91ff5efb9a4e 925ea0f289f5 92be326d073d 93389efba941 9532ad64de88 956f1a69d688 95b6fbae0990 "
        "962ed36159d1 967d5828b104 96a11ba00ebe 9783da418141 986de9932596 98a02b3f296a 98e5a5438070 992512a469b7 "
        "9961e5b4ac58 99b24e6d2154 9a4cd0acafc5 9c9dfc615d86 9d64a126bc88 9e6308af90a0 9e9a75fae68c 9ef7b62b552a "
        "9f4a36910a4a a05188e51e05 a08c8f1019d6 a0a8c766df20 a126664e45fe a18b8c90af7c a21e4d25d2be a22ab9558c3f "
        "a26362d47ac6 a2d1f9b89683 a2f579c5d033 a3663f192ab9 a3d660860cfc a3db199e755e a53598b2c721 a58658af032e "
        "a598169df92f a59c99fcbda4 a6f3f67b48e6 a6f713c8d2a1 a78c299cc40e a7a5ed9a257d a8237d224354 a8474f912c32 "
        "a86a38f520f8 a8f43fa0c0c5 a91c2280e75d a944e54208cf a97b3cd8fbb6 a98354492186 a9ce904d0b9f a9e4bcb90886 "
        "a9f3d58256d5 aa323b0911c1 aad7eaa902b9 aaf133b4138f ab4005c65f56 ab7cd0f2bc3c ac354cc5b06a ac3eae7797da "
        "ad5ec2611425 ad745733cda0 af059af69b2e af7c6417f860 affe1673878b b05fa059af88 b109c6a9d0cc b18de506ea50 "
        "b1938065094b b262ae0ce305 b3867aab066a b40ba1ccc3af b41f5e8d76e8 b45216c1115b b4f36668db8a b597bb2ff63a "
        "b5eb200eb429 b66996ffa96f b67d9944a4fa b89daf8bdffe ba1e792092ad ba3da95bc461 bb37a83a1a4b bbb1f1039d2b "
        "bc49e9fbbfc8 bcc959ce43ce bcdd7275f34c bdec434b03dd be2b24e99306 be47f4f4c3be bee8777eee52 c0186fd6dd69 "
        "c0e5fd7c2237 c1396ac72d0f c28a5af5bfcb c2a3c692cbfc c2b1903a3949 c2cc0b619a2f c3234a33f26b c39c04b4334e "
        "c489c2c2a86f c4cfb8e0cef6 c4db27f67d79 c6af0454be37 c785a7aaaa25 c7924218370d c7f15f35ce69 c945ac73f2e4 "
        "c982ae2d1ed0 c98c1d42ae70 c997897b815d c99b5f87c1b9 caed47e016de cb59bcb638c6 ccb8ed107c35 cd72f25261c4 "
        "ce163144d8c4 ce977a0a4b5b ced7a886a19e cfd8940471e5 d147965fbc41 d1c02887d7d0 d222964c673c d2673f6471d7 "
        "d2b2215fabb2 d2d2deaecdf3 d34212e46354 d48e8b64252f d5080c69bc50 d5eba73ef015 d5f03969ddb3 d63345f308ac "
        "d77b921ee39c d8793f907166 da246091bcf3 daca422be134 db0afc9ef451 db23192ee591 dd563a76a8d0 dd6f635f4d97 "
        "ddc2b186a29c deb809b73c21 ded132624f55 def85700504e df4843182a90 dfc5b221b44e e03d0becb347 e06a360cf0b2 "
        "e0b7a7304538 e1271c64f1bc e1f0239ca5e6 e226eca28a65 e31715df27eb e31d1ff01b1f e4585ebbdff2 e4b3ee875774 "
        "e4cd781664eb e558067d65ff e5f62b4a7f4b e66f7fa85518 e75ddf83ea80 e7ff56fd4d62 e81d49fddf41 e8afdcfe76bb "
        "e8d7fa922017 e8dde0994ddc e92190d8cf1c e95125c3f567 eb1669eceffe eb24844af44e eb7dba4b3185 eb9ca4c7ec66 "
        "ec601450887a ecba30404b83 edb8b3ffc419 ef98dd2f7cd3 efe10c789de1 f06f56d9d2ad f095ebd8da66 f1913f1a7f9b "
        "f19fed5a0301 f24c6594423a f275b13104d3 f357c5b78673 f4139efec71b f4623a68f601 f4de5505c981 f72852c817d8 "
        "f728ac18db91 f786acfcb21c f7ea59af1148 f831bff0ae15 fac69e02e36c fb3f3751dca5 fb4323fab571 fb9798a0d18d "
        "fbdec79d1edd fca5d6839012 fdc1d58a42d3 fe4c8e4ec063 fe6861d560f6 ff2f6b32d736 ff34324341c8 fff978018a66 "
    ).split()
)
KNOWN_SETS = "MT-bench / Spec-Bench / GSM8K test"


def normalize(text: str) -> str:
    """Whitespace collapsed and case folded: the form prompts are compared in."""
    return " ".join(text.split()).casefold()


def fingerprint(text: str) -> str:
    return hashlib.sha256(normalize(text).encode("utf-8")).hexdigest()[:12]


class HeldOut:
    """Says whether a prompt is an evaluation prompt: of a known evaluation set, or of ``eval_prompts``."""

    def __init__(self, eval_prompts: Iterable[str] = (), eval_source: str = "the evaluation prompts") -> None:
        self.eval_prompts = {normalize(p) for p in eval_prompts}
        self.eval_source = eval_source

    def reason(self, prompt: str) -> str | None:
        """Why ``prompt`` must not be trained on, or None when it may be."""
        if normalize(prompt) in self.eval_prompts:
            return f"it is one of {self.eval_source}"
        if fingerprint(prompt) in KNOWN_EVALUATION_PROMPTS:
            return f"it is a prompt of a known evaluation set ({KNOWN_SETS})"
        return None

    def check(self, prompt: str, where: str) -> None:
        """Raise ValueError naming ``where`` (the input and its id) when ``prompt`` is an evaluation prompt."""
        reason = self.reason(prompt)
        if reason is not None:
            short = prompt if len(prompt) <= 80 else prompt[:77] + "..."
            raise ValueError(
                f"{where}: prompt {short!r} cannot be training data: {reason}. Evaluation prompts are kept out of "
                "training (a head trained on them reports a tau it will not reach); use a training prompt set "
                "such as GSM8K train, or self_instruct"
            )
