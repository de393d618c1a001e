/* AMD_ZEN: gcc targets an AMD Zen core (-march=native there), where the kernels' Zen-only choices apply (docs/cpu.md,
 * "M = 1 kernels on AMD Zen 4 (session 16)"); other cores keep what was measured on them. */
#pragma once

#if defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
#define AMD_ZEN 1
#else
#define AMD_ZEN 0
#endif
